"""Conversation data for mid-training and SFT: task mixtures, rendering, BOS-aligned packing,
padding, and an exactly resumable loader state.

`ChatLoader` streams conversations of a Task (usually a TaskMixture) position by position (rank r
of W takes positions r, r+W, ...; position p is place p % len(task) of epoch p // len(task)). Epoch
0 reads the task in its own order; each later epoch reads a fresh permutation of it drawn from the
run's seed and the epoch number (`epoch_order`), the same on every rank, so the ranks' positions
still deal every conversation exactly once per epoch and batches do not repeat epoch after epoch.
A loader state saved before this reshuffle (no `epoch_seed`) keeps repeating epoch 0's order, so
the run it resumes continues exactly as it began. Each conversation is rendered with
`tokenizer.render_conversation` (ids + assistant mask); whole conversations are packed into rows of
seq_len + 1 tokens, best fit from a small buffer, every conversation starting with <|bos|>. When no
buffered conversation fits the rest of a row:

* fill="crop" (mid-training): the shortest buffered conversation is cropped to fill the row
  (no padding, every position trains; the cropped tail is dropped),
* fill="pad" (SFT): the row is padded; padded positions get target -1.

Targets are the next tokens; with mask="assistant" only tokens the assistant writes are targets
(tool outputs, user turns and padding are -1), with mask="all" every real token is. With
mask="assistant" a conversation whose row holds no assistant token (a prompt longer than the row
cuts the reply off) is skipped, not packed: it would train nothing, and rows of such conversations
made steps of no target at all (a loss of 0 in the log, an evaluation with nothing to score).
A conversation longer than a row is cut at the row's end (its rest is not trained) and counted
when packed (`truncated`, the run summary's conversations_truncated). `trainable_share` probes a task for
both before training.

State = the next stream position + the positions held in the buffer (re-rendered on load) and of
the skips read ahead of the last row, and the epochs' seed, so a resumed run reproduces the batches
(and counts) exactly.

Mixtures: `build_mixture` (a stage's conversations, its validation mixture), `test_holdouts` (the test
problems a checkpoint's chain trained on); leaving chat_eval's test problems out of a mixture is
nanochat/decontaminate.py's.
"""

from __future__ import annotations

import bisect
import json
import math
import random
from pathlib import Path
from dataclasses import dataclass
from typing import Sequence

import torch

from nanochat.errors import DataError, MissingDataError, RequestError
# keeping chat_eval's test problems out of training lives in decontaminate.py; build_mixture calls
# these two, the rest is re-exported so older imports (and callers' tests) of chat_data still work
from nanochat.decontaminate import _drop_held_out_twins, drop_eval_questions
from nanochat.decontaminate import EVAL_QUESTION_FILES, problem_key  # noqa: F401  (re-exported)
from nanochat.decontaminate import _eval_questions, _question_text, _read_eval_questions  # noqa: F401

MASKS = ("assistant", "all")
FILLS = ("pad", "crop")


class ChatLoader:
    """Iterator of (inputs, targets), LongTensor (batch_size, seq_len) on `device`."""

    def __init__(self, task, tokenizer, batch_size: int, seq_len: int, *, device="cpu", rank: int = 0,
                 world_size: int = 1, mask: str = "assistant", fill: str = "pad", buffer_size: int = 32,
                 loop: bool = True, limit: int | None = None, seed: int | None = 42):
        if mask not in MASKS:
            raise ValueError(f"mask: got {mask!r}; accepted: {'|'.join(MASKS)}")
        if fill not in FILLS:
            raise ValueError(f"fill: got {fill!r}; accepted: {'|'.join(FILLS)}")
        if len(task) == 0:
            raise ValueError("ChatLoader: the task has no conversations")
        assert batch_size >= 1 and seq_len >= 2 and buffer_size >= 1 and 0 <= rank < world_size
        assert seed is None or (isinstance(seed, int) and seed >= 0)
        self.task, self.tokenizer = task, tokenizer
        self.batch_size, self.seq_len, self.device = batch_size, seq_len, torch.device(device)
        self.rank, self.world_size = rank, world_size
        self.mask, self.fill, self.buffer_size, self.loop = mask, fill, buffer_size, loop
        self.limit = len(task) if limit is None else min(limit, len(task))  # positions of one epoch used
        self.pad_id = tokenizer.bos_token_id
        self.seed = seed                # epochs after the first: epoch_order(limit, seed, epoch); None: epoch 0's order
        self._orders: dict[int, list[int]] = {}   # epoch -> its order (the newest two kept: see _index)
        self.pos = rank                 # next stream position to render
        # (position, ids, trained-token mask, whether the conversation is longer than a row)
        self.buffer: list[tuple[int, list[int], list[int], bool]] = []
        self.conversations_used = 0     # whole or cropped conversations placed into rows
        self.skipped = 0                # conversations with no trained token in a row (mask "assistant"),
        #                                 counted once a conversation read after them is packed (or the
        #                                 stream ends): those read ahead of the last row are pending
        self._pending_skips: list[int] = []   # their stream positions (ascending)
        self.truncated = 0              # packed conversations longer than a row, cut at its end (the rest
        #                                 not trained); counted when packed, not when read into the buffer
        self._skip_run = 0              # ... in a row on this rank: a whole cycle of them trains nothing ever
        self._skip_seen: set[int] = set()   # ... their places in the task (reshuffled epochs: all of them = stuck)
        self.tokens_real = self.tokens_total = 0

    # -- stream ---------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.pos // self.limit

    def _index(self, pos: int) -> int:
        """The task index stream position `pos` reads: its place in its epoch's order."""
        epoch, place = divmod(pos, self.limit)
        if epoch == 0 or self.seed is None:
            return place
        if epoch not in self._orders:
            self._orders[epoch] = epoch_order(self.limit, self.seed, epoch)
            # positions are read in ascending order (a resumed buffer's too, and it reaches back an epoch
            # at most unless the task is smaller than the buffer): older orders are not needed again
            for old in sorted(self._orders)[:-2]:
                del self._orders[old]
        return self._orders[epoch][place]

    def _render(self, pos: int) -> tuple[int, list[int], list[int], bool]:
        """(pos, ids, mask) cut to a row of seq_len + 1 tokens, and whether the conversation was longer."""
        row = self.seq_len + 1
        ids, mask = self.tokenizer.render_conversation(self.task[self._index(pos)], max_tokens=row + 1)
        if self.mask == "all":
            mask = [1] * len(ids)
        return pos, ids[:row], mask[:row], len(ids) > row

    def _refill(self) -> None:
        while len(self.buffer) < self.buffer_size and (self.loop or self.pos < self.limit):
            entry = self._render(self.pos)
            self.pos += self.world_size
            if self.mask == "assistant" and not any(entry[2][1:]):   # ids[0] (<|bos|>) is never a target
                self._skip(entry[0])
                continue
            self._skip_run = 0
            self._skip_seen.clear()
            self.buffer.append(entry)
        if not self.buffer:   # a finite stream read to its end: every skip read is passed
            self._pass_skips(math.inf)

    def _pass_skips(self, packed_pos: float) -> None:
        """Count the pending skips read before the conversation at `packed_pos`, now packed. Counted
        when read, the summary's conversations_skipped included those the refill read ahead of the
        last trained row (up to a buffer's worth per rank, more where skips cluster)."""
        passed = bisect.bisect_left(self._pending_skips, packed_pos)
        self.skipped += passed
        del self._pending_skips[:passed]

    def _skip(self, pos: int) -> None:
        self._pending_skips.append(pos)
        self._skip_run += 1
        if not self.loop:
            return
        if self.seed is None:
            # epochs in one order: this rank's positions revisit the same conversations after at most
            # `limit` of them, so that many skipped in a row means none it will ever read trains anything
            stuck, who = self._skip_run >= self.limit, "none this rank reads"
        else:
            # reshuffled epochs deal a rank other conversations each epoch: only every conversation of
            # the task skipped in one run proves none trains (it would spin forever)
            self._skip_seen.add(self._index(pos))
            stuck, who = len(self._skip_seen) >= self.limit, "none of the mixture's"
        if stuck:
            raise RequestError(f"--max-seq-len {self.seq_len}: {self.limit:,} conversations in a row had no "
                               f"assistant token within a row of {self.seq_len + 1} tokens (the prompt cuts the "
                               f"reply off), so {who} trains anything; raise --max-seq-len")

    # -- packing --------------------------------------------------------------------------------
    def _take_best_fit(self, room: int) -> int | None:
        best = None
        for i, (_, ids, _, _) in enumerate(self.buffer):
            if len(ids) <= room and (best is None or len(ids) > len(self.buffer[best][1])):
                best = i
        return best

    def _row(self) -> tuple[list[int], list[int]] | None:
        """One row of seq_len + 1 (ids, mask); None when a finite stream is exhausted."""
        length = self.seq_len + 1
        ids: list[int] = []
        mask: list[int] = []
        while True:
            self._refill()
            if not self.buffer or len(ids) == length:
                break
            i = self._take_best_fit(length - len(ids))
            if i is None:
                if ids and self.fill == "pad":
                    break
                # crop: the shortest conversation fills the rest (an empty row takes the oldest one,
                # which only happens when a conversation alone is longer than the row)
                i = min(range(len(self.buffer)), key=lambda k: len(self.buffer[k][1])) if ids else 0
            packed_pos, cids, cmask, cut = self.buffer.pop(i)
            self._pass_skips(packed_pos)
            # counted here, not when read: the up to buffer_size conversations read ahead of the last
            # row have trained nothing yet (the summary's figure is as of the batches trained)
            self.truncated += cut
            room = length - len(ids)
            ids += cids[:room]
            mask += cmask[:room]
            self.conversations_used += 1
        if not ids:
            return None
        self.tokens_real += len(ids)
        self.tokens_total += length
        pad = length - len(ids)
        return ids + [self.pad_id] * pad, mask + [0] * pad

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for _ in range(self.batch_size):
            row = self._row()
            if row is None:
                break
            rows.append(row)
        if not rows:
            raise StopIteration
        while len(rows) < self.batch_size:  # the last batch of a finite stream: all-padding rows
            rows.append(([self.pad_id] * (self.seq_len + 1), [0] * (self.seq_len + 1)))
        ids = torch.tensor([r[0] for r in rows], dtype=torch.long)
        mask = torch.tensor([r[1] for r in rows], dtype=torch.bool)
        inputs = ids[:, :-1]
        targets = torch.where(mask[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], -1))
        if self.device.type == "cuda":
            inputs, targets = inputs.pin_memory(), targets.pin_memory()
        return (inputs.to(self.device, non_blocking=True).contiguous(),
                targets.to(self.device, non_blocking=True).contiguous())

    @property
    def fill_fraction(self) -> float:
        """Real (non-padding) tokens / row tokens so far."""
        return self.tokens_real / self.tokens_total if self.tokens_total else 0.0

    # -- resume ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"pos": self.pos, "buffer": [entry[0] for entry in self.buffer], "rank": self.rank,
                "world_size": self.world_size, "conversations_used": self.conversations_used,
                "skipped": self.skipped, "skipped_pending": list(self._pending_skips), "truncated": self.truncated,
                "tokens_real": self.tokens_real, "tokens_total": self.tokens_total, "truncated_when": "packed",
                "epoch_seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if (state.get("rank"), state.get("world_size")) != (self.rank, self.world_size):
            raise ValueError(f"--resume: the loader state was saved by rank {state.get('rank')} of "
                             f"{state.get('world_size')}; this is rank {self.rank} of {self.world_size}")
        # the order the saved run's epochs follow, before the buffer is rendered: a state from before
        # the per-epoch reshuffle (no epoch_seed) repeats epoch 0's order, as the run it continues did
        saved = state.get("epoch_seed")
        if saved is not None and self.seed is not None and int(saved) != self.seed:
            raise ValueError(f"--seed: the loader state's epochs were shuffled with --seed {saved}; this run's is "
                             f"{self.seed}; accepted: --seed {saved} (the original run's)")
        self.seed = None if saved is None else int(saved)
        self._orders.clear()
        self.pos = int(state["pos"])
        self.buffer = [self._render(int(p)) for p in state["buffer"]]
        self.conversations_used = int(state.get("conversations_used", 0))
        self.skipped = int(state.get("skipped", 0))   # an older state (no skipped_pending) counted its read-ahead
        self._pending_skips = [int(p) for p in state.get("skipped_pending", [])]
        self.truncated = int(state.get("truncated", 0))
        if state.get("truncated_when") != "packed":   # an older state counted its buffer when read
            self.truncated -= sum(entry[3] for entry in self.buffer)
        # the run's row fill so far (a resumed run's summary is the whole run's, not its tail's)
        self.tokens_real, self.tokens_total = int(state.get("tokens_real", 0)), int(state.get("tokens_total", 0))

    def close(self) -> None:  # API parity with the pretraining DataLoader
        pass


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order (a permutation of range(n)) in which epoch `epoch` of a looping ChatLoader reads its
    task: epoch 0 the task's own order (the first epoch of every run reads what it always did), each
    later one a shuffle seeded by (seed, epoch) alone, so every rank draws the same one. A string
    seed: random hashes it with sha512, the same in every process and on every machine."""
    order = list(range(n))
    if epoch > 0:
        random.Random(f"nanochat chat epoch {seed} {epoch}").shuffle(order)
    return order


def first_rows(batches, rows: int):
    """The first `rows` rows of a stream of (inputs, targets) batches: whole batches up to the one
    that holds the last of them, whose later rows get targets -1 (scored by nothing, the batch keeps
    its shape). The validation rows of a run stay the same at any device batch size (chat_train)."""
    for x, y in batches:
        if rows <= 0:
            return
        if rows < y.shape[0]:
            y = y.clone()
            y[rows:] = -1
        rows -= y.shape[0]
        yield x, y


def estimate_epoch_rows(task, tokenizer, seq_len: int, *, mask: str, fill: str, sample: int = 4000) -> float:
    """Rows of seq_len + 1 one epoch of `task` packs into (simulated on up to `sample`
    conversations, then scaled), for "-1 iterations = one epoch"."""
    n = len(task)
    used = min(n, sample)
    probe = ChatLoader(task, tokenizer, 1, seq_len, mask=mask, fill=fill, loop=False, limit=used)
    rows = 0
    while probe._row() is not None:
        rows += 1
    return rows * n / used


def first_trained_index(tokenizer, conversation: dict) -> int | None:
    """Index of the first trained token (mask 1) of the conversation's rendering, None if none:
    rows of seq_len + 1 tokens train it (mask "assistant") iff this is <= seq_len."""
    _, mask = tokenizer.render_conversation(conversation, max_tokens=2**62)
    return next((k for k in range(1, len(mask)) if mask[k]), None)


@dataclass
class Reach:
    """What trainable_share found: `cut` of `probed` conversations have no assistant token within a
    row (first_cut: the index in the task of the first such one); `need`: the --max-seq-len the
    shortest prompt among them needs (None: none has an assistant token); `long`: trainable ones
    longer than a row (cut at its end: the rest of their reply is not trained; first_long: the first)."""
    probed: int
    cut: int
    first_cut: int | None
    need: int | None
    long: int = 0
    first_long: int | None = None


def trainable_share(task, tokenizer, seq_len: int, *, sample: int = 512) -> Reach:
    """Probe the first `sample` conversations of `task` for rows of seq_len + 1 tokens under
    mask "assistant": how many the loader would skip (their replies start past the row)."""
    probed = min(len(task), sample)
    cut, first_cut, need, long, first_long = 0, None, None, 0, None
    for i in range(probed):
        ids, mask = tokenizer.render_conversation(task[i], max_tokens=2**62)
        first = next((k for k in range(1, len(mask)) if mask[k]), None)   # as first_trained_index
        if first is not None:
            need = first if need is None else min(need, first)
        if first is None or first > seq_len:
            cut += 1
            first_cut = i if first_cut is None else first_cut
        elif len(ids) > seq_len + 1:
            long += 1
            first_long = i if first_long is None else first_long
    return Reach(probed, cut, first_cut, need, long, first_long)


def check_replies_fit(train_mix, val_mix, tokenizer, seq_len: int, *, sample: int = 512,
                      file_sample: int = 10_000) -> list[str]:
    """SFT trains, and its val bpb scores, assistant tokens only: a conversation whose prompt fills
    a row of seq_len + 1 tokens is skipped by the loader. Before the model loads: a RequestError
    naming --max-seq-len when none of the first `sample` training (or validation) conversations
    reaches its reply, or naming an --extra-conversations file none of whose rows does (the
    user's own data would be left out whole, silently); the warnings it printed (rows skipped, a file's
    replies cut at a row's end)."""
    from nanochat.common import print0
    from nanochat.tasks import ConversationFile

    said = []
    for what, task in (("training", train_mix), ("validation", val_mix)):
        reach = trainable_share(task, tokenizer, seq_len, sample=sample)
        if reach.cut == reach.probed:
            need = f">= {reach.need}" if reach.need is not None else "a longer row"
            raise RequestError(f"--max-seq-len: got {seq_len}; accepted: {need} for this mixture: none of the first "
                               f"{reach.probed} {what} conversations has an assistant token within a row of "
                               f"{seq_len + 1} tokens (the prompts fill the row), so SFT would "
                               f"{'train' if what == 'training' else 'score'} nothing")
        if reach.cut and what == "training":   # a few very long prompts are normal; a tenth is worth a WARNING
            said.append(("WARNING: " if reach.cut * 10 >= reach.probed else "") +
                        f"--max-seq-len {seq_len}: {reach.cut} of the first {reach.probed} training conversations "
                        "have their reply cut off by the prompt; such conversations are skipped (they train nothing)")
        if reach.long and what == "training":
            said.append(("WARNING: " if reach.long * 10 >= reach.probed else "") +
                        f"--max-seq-len {seq_len}: {reach.long} of the first {reach.probed} training conversations "
                        f"are longer than a row of {seq_len + 1} tokens; they train up to the row's end (the rest "
                        "of the reply is not trained)")
    files = {t.source: t for t in train_mix.tasks if isinstance(t, ConversationFile)}
    for path, task in files.items():
        reach = trainable_share(task, tokenizer, seq_len, sample=file_sample)
        # the line the file's reader recorded for the row (a leading byte-order mark, blank lines and
        # rows decontamination left out all make it another line than row index + 1)
        if reach.cut:
            where = f"--extra-conversations {path}:{task.lines[reach.first_cut]}"
            if reach.cut == reach.probed:
                raise RequestError(f"{where}: no conversation of the file (the first {reach.probed:,} checked) has "
                                   f"an assistant token within a row of {seq_len + 1} tokens, so none would train; "
                                   f"--max-seq-len: got {seq_len}; accepted: >= {reach.need} for this file")
            said.append(f"WARNING: {where}: its reply starts past a row of {seq_len + 1} tokens (--max-seq-len "
                        f"{seq_len}); it and {reach.cut - 1} more of the first {reach.probed:,} conversations of the "
                        "file are skipped (they would train nothing)")
        if reach.long:   # the user's own replies cut short: the mixture's line above samples its first rows only
            said.append(f"WARNING: --extra-conversations {path}:{task.lines[reach.first_long]}: longer than a row of "
                        f"{seq_len + 1} tokens (--max-seq-len {seq_len}); it and {reach.long - 1} more of the first "
                        f"{reach.probed:,} conversations of the file train up to the row's end (the rest of the "
                        "reply is not trained)")
    for line in said:
        print0(line)
    return said


# ------------------------------------------------------------------------------------ mixtures

STAGES = ("mid", "sft", "rl")


def _unavailable_hint(e: Exception, test_holdout: int = -1) -> MissingDataError:
    from nanochat.tasks import DataUnavailableError
    assert isinstance(e, DataUnavailableError)
    # a MissingDataError: the scripts print it as one line and exit 2 (a ValueError was a traceback)
    if test_holdout >= 0:   # the test file --test-holdout trains on is what is missing: "pass --test-holdout N" misled
        return MissingDataError(f"{e}\n--test-holdout {test_holdout}: trains on this local test file past its first "
                                f"{test_holdout} problems, and it is missing; restore it, or point --data-dir at a "
                                "data root whose eval/ holds it")
    return MissingDataError(f"{e}\n--test-holdout: no train split is available; pass --test-holdout N to "
                            "train on the local test files minus their first N problems (chat_eval "
                            "--max-problems <= N then scores unseen problems), or make the train split "
                            "available (hub or *_train.jsonl)")


def _train_split_tasks(names: Sequence[str], data_dir, test_holdout: int) -> list:
    """MMLU / ARC / GSM8K training tasks: their train split, or test[holdout:] when asked."""
    from nanochat.tasks import ARC, GSM8K, MMLU, DataUnavailableError
    held = test_holdout >= 0
    factories = {
        "mmlu": lambda: MMLU("test", data_dir=data_dir, start=test_holdout) if held else
        MMLU("auxiliary_train", data_dir=data_dir),
        "arc": lambda: [ARC(s, "test", data_dir=data_dir, start=test_holdout) if held else
                        ARC(s, "train", data_dir=data_dir) for s in ("easy", "challenge")],
        "gsm8k": lambda: GSM8K("test", data_dir=data_dir, start=test_holdout) if held else
        GSM8K("train", data_dir=data_dir),
    }
    tasks = []
    for name in names:
        try:
            made = factories[name]()
        except DataUnavailableError as e:
            raise _unavailable_hint(e, test_holdout) from e
        tasks += made if isinstance(made, list) else [made]
    if held and any(len(t) == 0 for t in tasks):   # a whole test split held out: it would leave the mixture silently
        sizes = {Path(str(t.source)).name: t.num_examples() for t in tasks}
        raise RequestError(f"--test-holdout: got {test_holdout}; accepted: -1 or 0..{min(sizes.values()) - 1} (training "
                           f"takes the test problems past the holdout: {', '.join(f'{k} has {v}' for k, v in sizes.items())})")
    if held:
        _drop_held_out_twins(tasks, test_holdout)
        emptied = [Path(str(t.source)).name for t in tasks if len(t) == 0]
        if emptied:
            raise RequestError(f"--test-holdout: got {test_holdout}; accepted: -1 or a smaller N (every problem of "
                               f"{', '.join(emptied)} past the first {test_holdout} repeats a held-out one, so none "
                               "is left to train on)")
    return tasks


SFT_CONVERSATIONS = 10_000
VAL_SEED = 42   # the validation mixture's order, whatever --seed is (--seed's default: val bpb as before)


def build_mixture(stage: str, split: str, *, data_dir=None, test_holdout: int = -1, seed: int = 42,
                  extra: Sequence[str] = (), identity: str | None = None, decontaminate: bool = True):
    """The conversation mixture of a stage. split "train" trains; "val" is a small fixed mixture
    of test-split conversations for validation bits per byte (never trained on), the same whatever
    `seed`, `extra` and `identity` say, so val bpb stays comparable between runs (`seed` shuffles
    training only: an evaluation scores the first rows of the val mixture, and mid-training's crops
    depend on its order, so a val order that followed --seed scored other conversations per seed).
    `extra`: JSONL files of the user's own conversations mixed into mid / SFT training, a file named
    twice mixed in twice (read once); `identity`: the model's name in the built-in identity conversations (None: the
    default, nanochat-spark; "": left out, e.g. for an identity of the user's own)."""
    from nanochat.tasks import (GSM8K, MMLU, ConversationFile, IdentityConversations, SimpleSpelling, SpellingBee,
                                TaskMixture, get_conversations)
    from nanochat.tasks.identity import NAME as IDENTITY_NAME
    if stage not in STAGES:
        raise ValueError(f"stage: got {stage!r}; accepted: {'|'.join(STAGES)}")
    if split == "val":
        # MMLU / GSM8K test problems scored for val bpb: the first 200, or with --test-holdout N
        # only the N that training leaves out (N = 0: none; test[0:] is all trained on)
        held = 200 if test_holdout < 0 else min(200, test_holdout)
        tasks = [get_conversations("test", data_dir=data_dir), MMLU("test", data_dir=data_dir, stop=held),
                 GSM8K("test", data_dir=data_dir, stop=held), SpellingBee(200, "test", data_dir=data_dir)]
        return TaskMixture(tasks, seed=VAL_SEED)
    if split != "train":
        raise ValueError(f"split: got {split!r}; accepted: train|val")
    if stage == "rl":  # the GSM8K problems only
        return _train_split_tasks(("gsm8k",), data_dir, test_holdout)[0]   # a holdout of all of it: refused there
    # SFT takes the first SFT_CONVERSATIONS of the general chat set (SmolTalk's train split is 460K,
    # all of which mid-training has just seen): hours on a Spark for a second pass at 2% of the LR,
    # where upstream nanochat's SFT used 10K. Local conversation files are smaller than the cap.
    files = {path: ConversationFile(path) for path in dict.fromkeys(extra)}   # each read and checked once
    convs = get_conversations("train", data_dir=data_dir, **({"stop": SFT_CONVERSATIONS} if stage == "sft" else {}))
    own = [] if identity == "" else [IdentityConversations(1000, seed=seed, name=identity or IDENTITY_NAME)]
    spelling = dict(split="train", seed=seed, data_dir=data_dir)
    if stage == "mid":  # general chat, identity (oversampled), multiple choice, tool use, spelling (upstream's sizes)
        tasks = [convs, *own, *own, *_train_split_tasks(("mmlu", "arc", "gsm8k"), data_dir, test_holdout),
                 SimpleSpelling(200_000, **spelling), SpellingBee(80_000, **spelling)]
    else:  # sft: a smaller, cleaner mixture: chat, identity, ARC, GSM8K, a little spelling
        tasks = [convs, *own, *_train_split_tasks(("arc", "gsm8k"), data_dir, test_holdout),
                 SimpleSpelling(300, **spelling), SpellingBee(300, **spelling)]
    # before the mixture counts rows; off: a run resumed from before the check (--no-decontaminate)
    dropped = drop_eval_questions([convs, *files.values()], data_dir) if decontaminate else {}
    for path, task in files.items():
        if not task.rows:   # the user's own data left out whole: said once among start-up lines, then gone
            raise DataError(f"--extra-conversations {path}: every conversation of it ({dropped[task.source]:,}) asks "
                            "a chat_eval test question (MMLU / ARC / GSM8K) word for word, so none would train "
                            "(they are left out: chat_eval would score them as the model's own); drop the file or "
                            "give it other conversations")
    mix = TaskMixture(tasks + [files[path] for path in extra], seed=seed)
    mix.decontaminated = dropped   # {source: conversations left out}: the checkpoint records it (chat_train)
    return mix


# The chat_eval tasks whose local test files a stage's mixture trains on past their first N problems
# under --test-holdout N (build_mixture above: offline there are no train splits of these).
TEST_TRAINED = {"mid": ("MMLU", "ARC-Easy", "ARC-Challenge", "GSM8K"), "sft": ("ARC-Easy", "ARC-Challenge", "GSM8K"),
                "rl": ("GSM8K",)}


def test_holdouts(meta: dict, read_source, phase: str | None = None) -> tuple[dict[str, tuple[int, str]], bool]:
    """(task -> (N, stage), complete) for the checkpoint whose meta.json is `meta`: it, or one it was
    trained from, trained on that task's local test problems past the first N (the smallest N wins).
    A chat stage records its source's map as meta "source" -> "test_holdouts" when it starts, so the
    map survives the source's deletion (with "test_holdouts_complete": False when the chain was not
    known then); an older checkpoint's sources are read back with `read_source(source dict) -> meta`
    (CheckpointError: gone, and the map is not complete). An SFT or RL checkpoint without a source
    record is not complete either: it was trained from a checkpoint no one can name."""
    from nanochat.checkpoint import CheckpointError
    held: dict[str, tuple[int, str]] = {}

    def add(name, n, stage):
        if isinstance(n, int) and not isinstance(n, bool) and n >= 0 and (name not in held or n < held[name][0]):
            held[name] = (n, stage)

    for _ in range(len(TEST_TRAINED) + 1):   # rl <- sft <- mid <- base at most
        stage = meta.get("phase") or phase
        for name in TEST_TRAINED.get(stage, ()):
            add(name, (meta.get("config") or {}).get("test_holdout", -1), stage)
        src = meta.get("source")
        if not (isinstance(src, dict) and src.get("phase") in ("base", *TEST_TRAINED) and isinstance(src.get("step"), int)):
            # mid starts from base, which trains on no test problem; SFT and RL start from a chat
            # checkpoint, and one with no source recorded (older, or converted) hides what it trained on
            return held, stage not in ("sft", "rl")
        recorded = src.get("test_holdouts")
        if isinstance(recorded, dict):
            for name, entry in recorded.items():
                if isinstance(entry, (list, tuple)) and len(entry) == 2:
                    add(name, entry[0], entry[1])
            return held, src.get("test_holdouts_complete", True) is not False
        try:
            meta, phase = read_source(src), src["phase"]
        except CheckpointError:
            return held, False
    return held, True


def _conversation_key(messages) -> str:
    """Roles and contents only: other fields a file may carry do not make it another conversation."""
    return json.dumps([[m.get("role"), m.get("content")] for m in messages], ensure_ascii=False)


def validation_overlap(train_mix, val_mix) -> dict[str, int]:
    """For each --extra-conversations file in `train_mix`, how many of its rows are conversations of
    the validation mixture. Training on them makes val bpb read better than the model is (adding
    the local sft/*.jsonl itself as an extra file does: its test split is validation)."""
    from nanochat.tasks import ConversationFile
    files = {t.source: t for t in train_mix.tasks if isinstance(t, ConversationFile)}
    if not files:
        return {}
    held = {_conversation_key(val_mix[i]["messages"]) for i in range(len(val_mix))}
    return {src: n for src, f in files.items()
            if (n := sum(_conversation_key(row["messages"]) in held for row in f.rows))}


def rows_per_step(total_batch_size: int, seq_len: int) -> int:
    assert total_batch_size % seq_len == 0
    return total_batch_size // seq_len


def epoch_iterations(epoch_rows: float, total_batch_size: int, seq_len: int) -> int:
    """Optimizer steps for one epoch of `epoch_rows` rows (estimate_epoch_rows; at least 1), rounded
    up: the training loader loops, so the last step's rows past the epoch are the next epoch's first
    conversations."""
    return max(1, math.ceil(epoch_rows / rows_per_step(total_batch_size, seq_len)))
