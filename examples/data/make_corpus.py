"""Write examples/data/corpus.txt: deterministic English-like prose from a small grammar.

The demo needs a few hundred KB of text that ships with the repository and has structure
a small model can learn (spelling, word order, punctuation, recurring names). This
generator is the source; `corpus.txt` is its committed output, and `--check` verifies that
the two agree. The words and sentence patterns are this project's own.

    python examples/data/make_corpus.py            # (re)write corpus.txt
    python examples/data/make_corpus.py --check    # exit 1 if corpus.txt differs
"""

from __future__ import annotations

import argparse
import random
import sys
import textwrap
from pathlib import Path

OUT = Path(__file__).resolve().parent / "corpus.txt"
SEED = 1729
TARGET_BYTES = 400_000

NAMES = ["Ada", "Bram", "Cora", "Dale", "Edith", "Felix", "Greta", "Hugo", "Ines", "Jonah"]
PLACES = [
    "the mill",
    "the harbour",
    "the old bridge",
    "the orchard",
    "the market",
    "the lighthouse",
    "the forest road",
    "the library",
    "the river bank",
    "the hill farm",
]
NOUNS = [
    "lantern",
    "letter",
    "boat",
    "garden",
    "stone",
    "window",
    "horse",
    "bell",
    "map",
    "basket",
    "candle",
    "door",
    "field",
    "wagon",
    "book",
    "clock",
    "kettle",
    "rope",
    "fence",
    "song",
    "storm",
    "cloud",
    "key",
    "ladder",
    "coat",
    "bird",
    "river",
    "road",
]
ADJECTIVES = [
    "old",
    "quiet",
    "bright",
    "small",
    "heavy",
    "cold",
    "green",
    "broken",
    "warm",
    "narrow",
    "tall",
    "wet",
    "empty",
    "golden",
    "strange",
    "patient",
    "little",
    "dark",
]
VERBS_PAST = [
    "found",
    "carried",
    "mended",
    "painted",
    "opened",
    "watched",
    "lost",
    "sold",
    "cleaned",
    "counted",
    "followed",
    "remembered",
    "lifted",
    "hid",
    "noticed",
]
VERBS_INTRANS = [
    "waited",
    "laughed",
    "listened",
    "rested",
    "walked on",
    "sang softly",
    "stood still",
    "looked away",
    "hurried home",
    "sat down",
]
ADVERBS = [
    "slowly",
    "carefully",
    "at once",
    "again",
    "without a word",
    "before dawn",
    "in the rain",
    "after supper",
    "for a long time",
    "with great care",
]
TIMES = [
    "In the morning",
    "That evening",
    "Before the frost",
    "On the third day",
    "Late in the summer",
    "When the bell rang",
    "At first light",
    "Some weeks later",
]
WEATHER = [
    "The wind came down from the hills",
    "Rain fell on the roofs",
    "The sky was clear and pale",
    "A thin fog lay over the water",
    "The sun was low and red",
    "Snow had covered the road",
]
SAYINGS = [
    "We should go before it is dark",
    "I have never seen it so quiet",
    "Bring the lantern and the rope",
    "Nobody told me about the letter",
    "The river is higher than last year",
    "Wait here, I will come back",
    "It belongs to the old miller",
    "Count them again, slowly",
]
SAY_VERBS = ["said to", "asked", "whispered to", "called to", "answered", "told"]
LINKS = ["and", "but", "so", "while", "because", "until"]


def noun_phrase(rng: random.Random) -> str:
    """'the cold lantern', 'a map', 'her little boat'."""
    det = rng.choice(["the", "the", "a", "his", "her", "their"])
    noun = rng.choice(NOUNS)
    if rng.random() < 0.5:
        noun = f"{rng.choice(ADJECTIVES)} {noun}"
    if det == "a" and noun[0] in "aeiou":
        det = "an"
    return f"{det} {noun}"


def clause(rng: random.Random, subject: str) -> str:
    """One clause with `subject`: a transitive act, an intransitive one, or a movement."""
    kind = rng.random()
    if kind < 0.5:
        text = f"{subject} {rng.choice(VERBS_PAST)} {noun_phrase(rng)}"
    elif kind < 0.8:
        text = f"{subject} {rng.choice(VERBS_INTRANS)}"
    else:
        text = f"{subject} went to {rng.choice(PLACES)}"
    if rng.random() < 0.35:
        text += f" {rng.choice(ADVERBS)}"
    return text


def sentence(rng: random.Random, cast: list[str]) -> str:
    """One sentence about someone in `cast`: narration, weather or a line of dialogue."""
    who = rng.choice(cast)
    kind = rng.random()
    if kind < 0.15:
        return f"{rng.choice(WEATHER)}."
    if kind < 0.3:
        other = rng.choice([c for c in cast if c != who] or cast)
        return f'"{rng.choice(SAYINGS)}," {who} {rng.choice(SAY_VERBS)} {other}.'
    text = clause(rng, who)
    if rng.random() < 0.4:
        text += f" {rng.choice(LINKS)} {clause(rng, rng.choice(['she', 'he', 'they', who]))}"
    if rng.random() < 0.3:
        text = f"{rng.choice(TIMES)}, {text}"
    return text[0].upper() + text[1:] + "."


def chapter(rng: random.Random, number: int) -> str:
    """A titled chapter of a few paragraphs with a small recurring cast."""
    cast = rng.sample(NAMES, 3)
    place = rng.choice(PLACES)
    title = f"Chapter {number}. {cast[0]} and {place}"
    paragraphs = []
    for _ in range(rng.randint(3, 6)):
        body = " ".join(sentence(rng, cast) for _ in range(rng.randint(3, 8)))
        paragraphs.append(textwrap.fill(body, width=76))
    return title + "\n\n" + "\n\n".join(paragraphs) + "\n"


def generate(seed: int = SEED, target_bytes: int = TARGET_BYTES) -> str:
    """The corpus text: chapters until at least `target_bytes`, all ASCII."""
    rng = random.Random(seed)
    chapters: list[str] = []
    size = 0
    while size < target_bytes:
        chapters.append(chapter(rng, len(chapters) + 1))
        size += len(chapters[-1]) + 1
    return "\n".join(chapters)


def main() -> int:
    """Write corpus.txt, or with --check compare it with a fresh generation."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify corpus.txt, write nothing")
    args = parser.parse_args()
    text = generate()
    if args.check:
        same = OUT.exists() and OUT.read_text(encoding="ascii") == text
        print(f"{OUT.name}: {'up to date' if same else 'DIFFERS from the generator'}")
        return 0 if same else 1
    OUT.write_text(text, encoding="ascii")
    print(f"wrote {OUT} ({len(text):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
