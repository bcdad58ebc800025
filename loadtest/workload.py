"""What to send and when: length distributions, prompts (synthetic or a JSONL dataset), Poisson arrivals.

Everything is drawn from seeded generators, and request i of a run is the same whatever the timing, so two
targets given the same options receive the same requests.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Common English words; in the BPE vocabularies of Llama-family tokenizers each is one token after a space,
# so a text prompt of n words is close to n tokens (exact lengths need --prompt-kind token-ids).
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his "
    "her this which are be or an have had not they one you were their all "
    "but can has more its time may also new first these two other after people would "
    "been some when out them only into over then any most year school state work city "
    "water world house story music light river paper family market game night power table window garden"
)
WORDS = tuple(_WORD_TEXT.split(" "))


@dataclass(frozen=True)
class LengthDist:
    """A length in tokens: `N` or `fixed:N`, `uniform:LOW:HIGH` (inclusive), or `lognormal:MEDIAN:SIGMA[:MAX]`
    (exp of a normal around ln MEDIAN, rounded, at least 1, at most MAX when given)."""

    kind: str
    a: float
    b: float = 0.0
    cap: int | None = None

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        parts = spec.strip().split(":")
        try:
            if len(parts) == 1 or (parts[0] == "fixed" and len(parts) == 2):
                dist = cls("fixed", int(parts[-1]))
            elif parts[0] == "uniform" and len(parts) == 3:
                dist = cls("uniform", int(parts[1]), int(parts[2]))
            elif parts[0] == "lognormal" and len(parts) in (3, 4):
                cap = int(parts[3]) if len(parts) == 4 else None
                dist = cls("lognormal", float(parts[1]), float(parts[2]), cap)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"bad length {spec!r}: use N, fixed:N, uniform:LOW:HIGH or lognormal:MEDIAN:SIGMA[:MAX]"
            ) from None
        dist.check()
        return dist

    def check(self) -> None:
        if self.kind == "fixed" and self.a < 1:
            raise ValueError("a fixed length must be at least 1")
        if self.kind == "uniform" and not 1 <= self.a <= self.b:
            raise ValueError("uniform:LOW:HIGH needs 1 <= LOW <= HIGH")
        if self.kind == "lognormal" and (self.a < 1 or self.b < 0 or (self.cap is not None and self.cap < 1)):
            raise ValueError("lognormal:MEDIAN:SIGMA[:MAX] needs MEDIAN >= 1, SIGMA >= 0, MAX >= 1")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        value = max(1, round(math.exp(rng.gauss(math.log(self.a), self.b))))
        return min(value, self.cap) if self.cap is not None else value

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"uniform {int(self.a)}..{int(self.b)}"
        return f"lognormal median {self.a:g} sigma {self.b:g}" + (f" max {self.cap}" if self.cap else "")


@dataclass
class RequestSpec:
    """One request: a prompt (text or token ids) or chat messages, and how many tokens to ask for."""

    index: int
    max_tokens: int
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    prompt_tokens: int | None = None  # known exactly only for token-id prompts


class Workload:
    """Request i, drawn from a generator seeded with (seed, i)."""

    def __init__(
        self,
        input_len: LengthDist,
        output_len: LengthDist,
        *,
        chat: bool,
        prompt_kind: str = "text",
        token_id_range: tuple[int, int] = (100, 1000),
        dataset: Path | None = None,
        seed: int = 0,
    ) -> None:
        if prompt_kind not in ("text", "token-ids"):
            raise ValueError(f"unknown prompt kind {prompt_kind!r}")
        if prompt_kind == "token-ids" and chat:
            raise ValueError("token-id prompts need the completions endpoint (chat takes text messages)")
        self.input_len, self.output_len = input_len, output_len
        self.chat, self.prompt_kind, self.token_id_range, self.seed = chat, prompt_kind, token_id_range, seed
        self.dataset = load_dataset(dataset) if dataset is not None else None

    def request(self, index: int) -> RequestSpec:
        rng = random.Random(f"{self.seed}:{index}")
        if self.dataset is not None:
            return self._from_dataset(index, rng)
        length, max_tokens = self.input_len.sample(rng), self.output_len.sample(rng)
        if self.prompt_kind == "token-ids":
            low, high = self.token_id_range
            ids = [rng.randrange(low, high) for _ in range(length)]
            return RequestSpec(index, max_tokens, prompt=ids, prompt_tokens=length)
        # A leading request number keeps prompts apart from the first token, so the prefix cache never hits.
        text = " ".join([str(index), *(rng.choice(WORDS) for _ in range(max(0, length - 1)))])
        if self.chat:
            return RequestSpec(index, max_tokens, messages=[{"role": "user", "content": text}])
        return RequestSpec(index, max_tokens, prompt=text)

    def _from_dataset(self, index: int, rng: random.Random) -> RequestSpec:
        assert self.dataset is not None
        row = self.dataset[index % len(self.dataset)]
        max_tokens = int(row.get("max_tokens") or row.get("output_len") or self.output_len.sample(rng))
        if "messages" in row:
            messages = row["messages"]
        elif isinstance(row["prompt"], str) and self.chat:
            messages = [{"role": "user", "content": row["prompt"]}]
        else:
            messages = None
        if self.chat:
            if messages is None:
                raise ValueError("token-id dataset prompts need the completions endpoint")
            return RequestSpec(index, max_tokens, messages=messages)
        if messages is not None and "prompt" not in row:
            # A chat row sent to /v1/completions: its contents joined as plain text.
            return RequestSpec(index, max_tokens, prompt="\n".join(m["content"] for m in messages))
        prompt = row["prompt"]
        return RequestSpec(
            index, max_tokens, prompt=prompt, prompt_tokens=len(prompt) if isinstance(prompt, list) else None
        )

    def describe(self) -> dict[str, object]:
        if self.dataset is not None:
            return {"dataset_rows": len(self.dataset), "output_len_default": self.output_len.describe()}
        return {
            "input_len": self.input_len.describe(),
            "output_len": self.output_len.describe(),
            "prompt_kind": self.prompt_kind,
        }


def load_dataset(path: Path) -> list[dict]:
    """JSONL, one request a line: {"prompt": text or token ids} or {"messages": [...]}, optionally with
    "max_tokens" (or "output_len")."""
    rows = []
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
                raise ValueError(f"{path}:{number}: each line needs a 'prompt' or 'messages' field")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def poisson_arrivals(rate: float, rng: random.Random) -> Iterator[float]:
    """Send times in seconds from the start of a run: the first at 0, then exponential gaps of mean 1/rate
    (a Poisson process of `rate` requests per second)."""
    if rate <= 0:
        raise ValueError("the request rate must be positive")
    moment = 0.0
    while True:
        yield moment
        moment += rng.expovariate(rate)
