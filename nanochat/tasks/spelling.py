"""SpellingBee: "how many 'r' are in 'strawberry'?" answered by spelling the word out and checking
with the calculator tool (`"strawberry".count("r")`), ending in '#### N' like GSM8K. SimpleSpelling:
"spell 'apple'" answered letter by letter: the token -> letters map SpellingBee's counting needs, as
plain practice (mid-training mixes 200K of it with 80K SpellingBee, as upstream nanochat's did).

Examples are generated on the fly from a word list with a seed: example i always uses
random.Random(f"{seed}/{split}/{i}"), so the task is reproducible and effectively unbounded. Train and
test use disjoint words (crc32(word) % 10 == 0 goes to test).
Word list: `words.txt` (one lowercase word per line), local only (no hub fallback).
"""

from __future__ import annotations

import random
import re
import string
import zlib

from nanochat.errors import DataError, MissingDataError
from nanochat.tasks.common import DataUnavailableError, Task, find_local_file
from nanochat.tasks.gsm8k import answers_match, extract_answer

_QUESTIONS = (
    "How many times does the letter {l} appear in the word {w}?",
    "How many {l}'s are in {w}?",
    "Count the number of '{l}' in \"{w}\".",
    "In the word {w}, how many times do you see the letter {l}?",
    "how many {l} are there in {w}",
    "What is the count of the letter {L} in the word {W}?",
    "Can you tell me how many times '{l}' occurs in '{w}'?",
    "Number of {l} letters in {w}?",
)
_SPLITS = ("train", "test")


def load_words(data_dir=None) -> list[str]:
    path, tried = find_local_file("words", ["words.txt"], data_dir)
    if path is None:
        where = "\n  ".join(map(str, tried))
        # no hub copy exists: say how to make one, not only where it was looked for
        raise DataUnavailableError(f"word list 'words.txt' not found.\nLocal files tried (set "
                                   f"NANOCHAT_EVAL_DIR or pass --data-dir):\n  {where}\nHub: no hub fallback; "
                                   f"create words.txt with one lowercase a-z word per line in one of those "
                                   f"folders, e.g. grep -x '[a-z]*' /usr/share/dict/words > words.txt")
    try:
        words = [w.strip() for w in path.read_text(encoding="utf-8").splitlines()]
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e}); re-create the word list") from None
    words = [w for w in words if w.isalpha() and w.islower() and w.isascii()]
    if not words:   # rng.choice([]) stopped the evaluation with an IndexError after the model loaded
        raise MissingDataError(f"{path}: no usable words (lowercase a-z, one per line); re-create the word list")
    return words


class _WordTask(Task):
    """`size` examples drawn from the split's words (train and test words are disjoint)."""

    eval_type = "generative"
    name = "words"

    def __init__(self, size: int = 1000, split: str = "train", *, seed: int = 0, data_dir=None, **kw):
        super().__init__(**kw)
        if split not in _SPLITS:
            raise ValueError(f"{self.name} split: got {split!r}; accepted: {'|'.join(_SPLITS)}")
        if size < 1:
            raise ValueError(f"{self.name} size: got {size}; accepted: >= 1")
        in_test = lambda w: zlib.crc32(w.encode()) % 10 == 0  # noqa: E731
        words = load_words(data_dir)
        self.words = [w for w in words if in_test(w) == (split == "test")]
        if not self.words:   # a short list can leave a split without words (1 in 10 go to test)
            raise MissingDataError(f"{self.name}: none of the {len(words)} words of the word list falls in the "
                                   f"{split} split (crc32(word) % 10 == 0 is test); use a longer word list")
        self.size, self.split, self.seed = size, split, seed

    def num_examples(self) -> int:
        return self.size


_SPELL = ("Spell the word {w}.", "How do you spell {w}?", "Spell \"{w}\" letter by letter.", "spell {w}",
          "Can you spell out {W} for me?", "What are the letters of the word {w}?")


class SimpleSpelling(_WordTask):
    name = "SimpleSpelling"

    def get_example(self, index: int) -> dict:
        rng = random.Random(f"spell/{self.seed}/{self.split}/{index}")
        word = rng.choice(self.words)
        question = rng.choice(_SPELL).format(w=word, W=word.capitalize())
        answer = f"{word} is spelled {', '.join(word)}."
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                "word": word}

    def evaluate(self, conversation: dict, completion: str) -> bool:
        """The word's letters, comma-separated and ending in '.', and not the tail of a longer
        spelling: "c, a, t." spells "cat", not "at" (a plain substring test passed it)."""
        spelled = re.escape(", ".join(conversation["word"]) + ".")
        return re.search(r"(?<![A-Za-z], )(?<![A-Za-z])" + spelled, completion) is not None


class SpellingBee(_WordTask):
    name = "SpellingBee"

    def get_example(self, index: int) -> dict:
        rng = random.Random(f"{self.seed}/{self.split}/{index}")
        word = rng.choice(self.words)
        letter = rng.choice(word) if rng.random() < 0.8 else rng.choice(string.ascii_lowercase)
        count = word.count(letter)
        question = rng.choice(_QUESTIONS).format(l=letter, L=letter.upper(), w=word, W=word)
        plural = "" if count == 1 else "s"
        marks = ", ".join(f"{c}*" if c == letter else c for c in word)
        parts = [
            {"type": "text", "text": f"Let me spell \"{word}\" out and mark every '{letter}':\n{marks}\n"
                                     f"That gives {count}. Checking with Python:\n\n"},
            {"type": "python", "text": f'"{word}".count("{letter}")'},
            {"type": "python_output", "text": str(count)},
            {"type": "text", "text": f"\n\nThe letter '{letter}' appears {count} time{plural} in "
                                     f"\"{word}\".\n\n#### {count}"},
        ]
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": parts}],
                "answer": str(count), "word": word, "letter": letter}

    def evaluate(self, conversation: dict, completion: str) -> bool:
        return answers_match(extract_answer(completion), conversation["answer"])

    def reward(self, conversation: dict, completion: str) -> float:
        return float(self.evaluate(conversation, completion))
