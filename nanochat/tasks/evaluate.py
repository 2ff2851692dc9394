"""Running a chat model over a task: categorical (letter logits) and generative (Engine) loops,
pass@k over samples, distributed sharding, and ChatCORE.

Under torch.distributed each rank scores its share of the problems (categorical: whole batches of
one process's batching; generative: every world-th problem, each sampled with its own seed), and
one collective at a task's end gathers the per-problem results, summed in problem order: the
scores are those of one process, to the last bit. A rank whose part raised makes every rank raise
there (the others an OtherRankError naming it) instead of leaving them at a collective.

Used by scripts/chat_eval.py and, for periodic evals, by the SFT / RL recipes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from nanochat.errors import RequestError
from nanochat.tasks.common import Task


@dataclass
class TaskResult:
    name: str
    passed: int
    total: int
    # generative: [j] = expected number of problems solved by j + 1 samples drawn from the ones made
    # (summed unbiased estimates, see pass_at_k); the last entry equals `passed`
    passed_at: tuple[float, ...] = ()

    @property
    def accuracy(self) -> float:
        return self.passed / self.total if self.total else 0.0

    def pass_at(self, k: int) -> float:
        """pass@k, the unbiased estimate over all samples drawn (k <= the samples drawn)."""
        if not 1 <= k <= len(self.passed_at):
            raise ValueError(f"pass@{k}: the evaluation drew {len(self.passed_at)} sample(s) per problem")
        return self.passed_at[k - 1] / self.total if self.total else 0.0


def _dist() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class OtherRankError(RuntimeError):
    """Raised on every other rank when one rank's part of a task failed (gather_ranks): names that rank and
    its error. `memory_kind` is out_of_memory_kind of that error, so out_of_memory_hint names the flag
    to lower on the rank that says the error (rank 0), which is not the one that ran out."""

    def __init__(self, message: str, memory_kind: str | None, rank: int, world: int):
        super().__init__(message)
        self.memory_kind, self.where = memory_kind, f"rank {rank} of {world}"


def gather_ranks(label: str, mine: list, error: Exception | None) -> list:
    """Collective at the end of a task's loop: every rank's per-problem results, concatenated and
    sorted by problem (the order one process makes them in, so sums over them are the same floats),
    or, when a rank's part raised, an error on every rank together: its own on a rank that failed,
    OtherRankError on the others. One collective either way: before this, a rank that failed alone
    (its own out of memory) left the others at the task's counts all-reduce, which failed when its
    process group went ("Connection closed by peer"), and torchrun killed it before it said why."""
    rank, world = _dist()
    if world == 1:
        if error is not None:
            raise error
        return sorted(mine)
    import torch.distributed as dist

    said = None if error is None else (f"{type(error).__name__}: {error}", out_of_memory_kind(error),
                                       isinstance(error, RequestError))
    parts: list = [None] * world
    dist.all_gather_object(parts, (mine if error is None else None, said))   # NCCL: via the current CUDA device
    if error is not None:
        raise error
    failed = [(r, s) for r, (_, s) in enumerate(parts) if s is not None]
    if failed:
        r, (text, memory_kind, request) = failed[0]
        message = f"{label}: rank {r} of {world} failed: {text}"
        raise RequestError(message) if request and memory_kind is None else \
            OtherRankError(message, memory_kind, r, world)
    return sorted(x for part, _ in parts for x in part)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that k of n samples, c of them correct, drawn without replacement include a
    correct one: 1 - C(n-c, k) / C(n, k), the unbiased pass@k estimator of Chen et al. 2021
    (https://arxiv.org/abs/2107.03374, section 2.1), as a product to stay exact for large n."""
    assert 0 <= c <= n and 1 <= k <= n, (n, c, k)
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def _problems(task: Task, max_problems: int | None) -> int:
    """How many problems are scored: the task's first max_problems, in the task's own order, which is
    one fixed shuffle for MMLU and HumanEval (common.fixed_order) and already random for GSM8K and
    SpellingBee, so a cap scores a spread of the whole set, the same every run, and a --test-holdout
    model's held-out problems are exactly these first ones."""
    return len(task) if max_problems is None else min(max_problems, len(task))


def _indices(task: Task, max_problems: int | None) -> range:
    """This rank's share of the scored problems (_problems): every world-th one."""
    rank, world = _dist()
    return range(rank, _problems(task, max_problems), world)


def letter_token_ids(tokenizer, letters) -> list[int]:
    """One token id per answer letter (what the model emits right after <|assistant_start|>)."""
    ids = []
    for letter in letters:
        tokens = tokenizer.encode(letter)
        if len(tokens) != 1:
            raise ValueError(f"answer letter {letter!r} encodes to {len(tokens)} tokens; the categorical "
                             "eval needs one token per letter")
        ids.append(tokens[0])
    return ids


def _keep_end(tokens: list[int], max_len: int) -> list[int]:
    """The first token (BOS) and the last max_len - 1 tokens of an over-long prompt."""
    return tokens if len(tokens) <= max_len else tokens[:1] + tokens[len(tokens) - max_len + 1:]


def run_categorical(model, tokenizer, task: Task, device, *, batch_size: int = 8,
                    max_problems: int | None = None, name: str | None = None) -> TaskResult:
    """Accuracy of argmax over the answer letters' logits at the first assistant position.

    Ranks take whole batches of one process's batching (rank r: batches r, r + world, ...), so each
    problem is scored in a batch of the same problems, padded to the same length, as on one process:
    a batch's shape picks its kernels on a GPU, and a near-tie between two letters' logits then broke
    differently on 2 ranks than on 1."""
    import torch

    if batch_size < 1:
        raise ValueError(f"--batch-size: got {batch_size}; accepted: >= 1")
    label = name or getattr(task, "name", type(task).__name__)
    rank, world = _dist()
    n = _problems(task, max_problems)
    pad = tokenizer.bos_token_id
    max_len = int(getattr(getattr(model, "config", None), "sequence_len", 1 << 30))
    scored, error = [], None
    try:
        for b0 in range(rank * batch_size, n, world * batch_size):
            idx = range(b0, min(b0 + batch_size, n))
            convs = [task[i] for i in idx]
            # a prompt longer than the context keeps its start token and its end (the choices and the
            # answer slot), as the model saw every conversation in training
            prompts = [_keep_end(tokenizer.render_for_completion(c), max_len) for c in convs]
            T = max(len(p) for p in prompts)
            x = torch.full((len(prompts), T), pad, dtype=torch.long)
            for r, p in enumerate(prompts):
                x[r, : len(p)] = torch.tensor(p)
            with torch.no_grad():
                logits = model(x.to(device))
            for r, (i, conv, p) in enumerate(zip(idx, convs, prompts)):
                scored.append((i, _letter_passed(task, conv, logits[r, len(p) - 1], tokenizer)))
    except Exception as e:   # said together with the other ranks (gather_ranks), not left at a collective
        error = e
    results = gather_ranks(label, scored, error)
    return TaskResult(label, sum(ok for _, ok in results), len(results))


def _letter_passed(task: Task, conv, logits, tokenizer) -> int:
    """1 when the answer letter with the largest logit is right. A NaN logit never wins (argmax takes
    NaN as the maximum: a diverged model would score every gold-"A" question); no finite letter
    logit = no answer."""
    import torch

    letters = conv["letters"]
    choice_logits = logits[letter_token_ids(tokenizer, letters)].float()
    finite = torch.isfinite(choice_logits)
    if not bool(finite.any()):
        return 0
    predicted = letters[int(choice_logits.masked_fill(~finite, float("-inf")).argmax())]
    return int(bool(task.evaluate(conv, predicted)))


def completion_text(tokenizer, ids) -> str:
    """Generated ids -> the answer text: text parts and calculator outputs (python source dropped)."""
    from nanochat.engine import assistant_parts

    return "".join(p["text"] for p in assistant_parts(tokenizer, ids) if p["type"] != "python")


def run_generative(engine, tokenizer, task: Task, device, *, num_samples: int = 1, max_new_tokens: int = 512,
                   temperature: float = 0.0, top_k: int | None = 50, seed: int = 42,
                   max_problems: int | None = None, name: str | None = None, log=None,
                   rows_per_call: int = 0) -> TaskResult:
    """pass@num_samples: a problem passes when any sample's completion evaluates true; the result's
    `pass_at(k)` gives pass@k for every k up to num_samples. Every sample is scored, so pass@k for
    k < num_samples is the unbiased estimate from all of them, not the luck of the first k.
    rows_per_call > 0 draws a problem's samples that many at a time (a KV cache of that many rows:
    chat_rl's --sample-batch-size); 0 draws them all in one call."""
    if num_samples < 1:
        raise ValueError(f"--num-samples: got {num_samples}; accepted: >= 1")
    if rows_per_call < 0:
        raise ValueError(f"rows_per_call: got {rows_per_call}; accepted: >= 0 (0 = all samples in one call)")
    label = name or getattr(task, "name", type(task).__name__)
    limit = engine.max_seq_len
    # problem i draws with seed + its index (in a shuffled task, its file position: Task.seed_index),
    # and the log names it by that position too (HumanEval's "problem 37" is HumanEval/37): the same
    # samples on any number of ranks
    seed_of = getattr(task, "seed_index", lambda i: i)
    scored, error = [], None   # (problem, samples that passed)
    try:
        for k, i in enumerate(_indices(task, max_problems)):
            conv = task[i]
            prompt = tokenizer.render_for_completion(conv)
            budget = min(max_new_tokens, limit - len(prompt))
            if budget < 1:  # the prompt alone fills the context: counts as a failure, visibly
                if log:
                    log(f"  {label} problem {seed_of(i)}: prompt of {len(prompt)} tokens does not fit the context ({limit})")
                scored.append((i, 0))
                continue
            seqs = _draw(engine, prompt, num_samples, rows_per_call or num_samples, budget, temperature, top_k,
                         seed + seed_of(i))
            completions = [completion_text(tokenizer, s[len(prompt):]) for s in seqs]
            scored.append((i, sum(bool(task.evaluate(conv, c)) for c in completions)))
            if log and k < 2:  # named: chat_eval prints a task's score line only after its examples
                log(f"  {label} example {seed_of(i)}: {scored[-1][1]}/{num_samples} passed | {completions[0][:200]!r}")
    except Exception as e:   # said together with the other ranks (gather_ranks), not left at a collective
        error = e
    # summed in problem order, as one process sums them: the same pass@k floats on any number of ranks
    results, passed_at = gather_ranks(label, scored, error), [0.0] * num_samples
    for _, correct in results:
        for j in range(num_samples):
            passed_at[j] += pass_at_k(num_samples, correct, j + 1)
    return TaskResult(label, round(passed_at[-1]), len(results), tuple(passed_at))


# a later chunk's seed: apart from every problem's first-chunk seed (seed + i) in any real task
_CHUNK_SEED_STRIDE = 1_000_003


def _draw(engine, prompt, num_samples: int, rows: int, budget: int, temperature, top_k, seed: int) -> list:
    """num_samples sequences of one prompt, generated `rows` at a time. The first chunk's seed is
    `seed` (one chunk: exactly the single call it always was); the sampler's seed range is uint64,
    so seeds wrap into it (a --seed near its top stopped the run midway)."""
    from nanochat.sampling import MAX_SEED

    seqs = []
    for chunk, start in enumerate(range(0, num_samples, rows)):
        part, _ = engine.generate_batch(prompt, num_samples=min(rows, num_samples - start), max_tokens=budget,
                                        temperature=temperature, top_k=top_k,
                                        seed=(seed + chunk * _CHUNK_SEED_STRIDE) % (MAX_SEED + 1))
        seqs += part
    return seqs


# what torch's other allocators raise as a plain RuntimeError when memory runs out
_OUT_OF_MEMORY = ("DefaultCPUAllocator: can't allocate memory", "MPS backend out of memory")


def out_of_memory_kind(e: BaseException) -> str | None:
    """Which memory `e` says ran out ("GPU memory", "CPU memory", "MPS memory"), or None when it is
    not an out-of-memory error. torch.OutOfMemoryError is the CUDA allocator's; the CPU and MPS
    allocators raise a plain RuntimeError that only its text tells apart."""
    import torch

    if isinstance(e, OtherRankError):   # another rank's, said here
        return e.memory_kind
    if isinstance(e, torch.OutOfMemoryError):
        return "GPU memory"
    if isinstance(e, RuntimeError):
        for text, kind in zip(_OUT_OF_MEMORY, ("CPU memory", "MPS memory")):
            if text in str(e):
                return kind
    return None


@contextmanager
def out_of_memory_hint(what: str, flag: str, value: int, also: str | None = None):
    """An evaluation that runs out of memory inside this block raises a RequestError (scripts print it
    as one line, exit 2) naming what ran out and the flag that sets its memory with the value it had,
    instead of torch's page of traceback and allocator statistics. `also`: another remedy, e.g.
    "a smaller --max-new-tokens (now 512)". torch.OutOfMemoryError is torch.cuda.OutOfMemoryError;
    the CPU and MPS allocators raise a plain RuntimeError."""
    try:
        yield
    except RuntimeError as e:
        if out_of_memory_kind(e) is None:
            raise
        remedies = ([f"a smaller {flag} (e.g. {value // 2})"] if value > 1 else []) + ([also] if also else [])
        advice = ("pass " + " or ".join(remedies) if remedies else
                  f"{flag} is at its smallest: the model leaves too little memory on this device")
        where = f" on {e.where}" if isinstance(e, OtherRankError) else ""
        raise RequestError(f"{what}: out of memory{where} at {flag} {value}; {advice}") from e


def check_model_vocab(meta: dict, tokenizer, checkpoint, tokenizer_at) -> None:
    """A CheckpointError, before the model loads, when the checkpoint's model has fewer token ids than
    the tokenizer it would read prompts with (meta.json's model_config vocab_size): a model trained with
    another tokenizer, in a checkpoint that records no tokenizer fingerprint (load_model's check),
    stopped the evaluation at its first prompt with torch's "IndexError: index out of range in self"
    (the tokenizer's special tokens are its last ids), or, inside the padded table, read untrained rows."""
    config = meta.get("model_config")
    vocab = config.get("vocab_size") if isinstance(config, dict) else None
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab >= tokenizer.vocab_size:
        return   # a broken model_config: load_model names it
    from nanochat.checkpoint_io import CheckpointError

    lacking = [name for name in tokenizer.special_tokens if tokenizer.encode_special(name) >= vocab]
    raise CheckpointError(
        f"{checkpoint}: the model reads token ids 0..{vocab - 1} but the tokenizer at {tokenizer_at} has "
        f"{tokenizer.vocab_size} ({', '.join(lacking) or 'ordinary tokens'} among those the model lacks): it was "
        "trained with another tokenizer; restore that one, or evaluate a model trained with this one")


def chatcore(accuracies: dict[str, float], baselines: dict[str, float]) -> float:
    """Mean centered accuracy over the evaluated tasks ((acc - b) / (1 - b))."""
    from nanochat.core_eval import centered_accuracy

    if not accuracies:
        raise ValueError("chatcore: got no task results")
    return sum(centered_accuracy(a, baselines[n]) for n, a in accuracies.items()) / len(accuracies)
