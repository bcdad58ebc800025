"""The types of the plugin's settings (vllm_neuron/settings.py): how each reads its environment variable,
checks its --additional-config value, and what argparse takes for its `vllm-neuron serve` flag.

Every error names the setting and says what it takes, so the CLI and the platform can show it as it is."""

from dataclasses import dataclass
from typing import Any


def _alternatives(choices: tuple[str, ...], quote: str = "") -> str:
    """'a, b or c' (each quoted by `quote`)."""
    quoted = [f"{quote}{choice}{quote}" for choice in choices]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


class Kind:
    """A setting's type; subclasses implement what their setting takes (a variable, a key, or both)."""

    what = "a value"  # for messages and the doc: "an integer", "a list of integers", ...

    def parse(self, name: str, raw: str) -> Any:
        """The value of the environment variable `name`, set to `raw` (not blank)."""
        raise ValueError(f"{name} has no environment variable")

    def check(self, key: str, value: Any) -> Any:
        """The --additional-config value of `key`, checked."""
        raise ValueError(f"{key} is not an --additional-config key")

    def flag_keywords(self) -> dict[str, Any]:
        """argparse's keywords for the setting's flag (beside dest, default, help and metavar)."""
        return {}


@dataclass(frozen=True)
class Text(Kind):
    """A name (compared lowercased) or a path (kept as written)."""

    lower: bool = True

    @property
    def what(self) -> str:  # type: ignore[override]
        return "a name" if self.lower else "a path"

    def parse(self, name: str, raw: str) -> str:
        return raw.strip().lower() if self.lower else raw.strip()


@dataclass(frozen=True)
class Choice(Kind):
    choices: tuple[str, ...]

    @property
    def what(self) -> str:  # type: ignore[override]
        return _alternatives(self.choices, "`")

    def parse(self, name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in self.choices:
            raise ValueError(f"{name}={value!r}: use {_alternatives(self.choices)}")
        return value

    def check(self, key: str, value: Any) -> str:
        if value not in self.choices:
            quoted = _alternatives(self.choices, '"')
            raise ValueError(f"{key} must be {quoted}, got {value!r}")
        return value

    def flag_keywords(self) -> dict[str, Any]:
        return {"choices": list(self.choices)}


@dataclass(frozen=True)
class Switch(Kind):
    what = "`1` or `0`"

    def parse(self, name: str, raw: str) -> bool:
        value = raw.strip().lower()
        if value in ("0", "false", "no", "off"):
            return False
        if value in ("1", "true", "yes", "on"):
            return True
        raise ValueError(f"{name}={value!r}: use 1 or 0")

    def flag_keywords(self) -> dict[str, Any]:
        return {"action": "store_true"}


@dataclass(frozen=True)
class Integer(Kind):
    minimum: int | None = None  # None: any integer
    hint: str = ""  # after the type in messages, e.g. " (0 disables the cap)"

    @property
    def what(self) -> str:  # type: ignore[override]
        return {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
            self.minimum, f"an integer of at least {self.minimum}"
        )

    def parse(self, name: str, raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"{name}={raw.strip()!r} is not {self.what}{self.hint}") from None
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{name}={value} is not {self.what}{self.hint}")
        return value

    def check(self, key: str, value: Any) -> int:
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or (self.minimum is not None and value < self.minimum)
        ):
            raise ValueError(f"{key} must be {self.what}{self.hint}, got {value!r}")
        return value

    def flag_keywords(self) -> dict[str, Any]:
        return {"type": int}


@dataclass(frozen=True)
class Fraction(Kind):
    what = "a number above 0 and below 1"

    def parse(self, name: str, raw: str) -> float:
        try:
            value = float(raw.strip())
        except ValueError:
            raise ValueError(f"{name}={raw.strip()!r} is not a number") from None
        if not 0 < value < 1:
            raise ValueError(f"{name}={value!r} must be above 0 and below 1")
        return value

    def flag_keywords(self) -> dict[str, Any]:
        return {"type": float}


@dataclass(frozen=True)
class IntList(Kind):
    """Comma-separated in a variable, a JSON list in --additional-config."""

    hint: str = ""  # after the type in messages, e.g. " ([] turns mixed calls off)"
    what = "a list of integers"

    def parse(self, name: str, raw: str) -> tuple[int, ...]:
        try:
            return tuple(int(part) for part in raw.split(",") if part.strip())
        except ValueError:
            raise ValueError(f"{name}={raw.strip()!r} must be a comma-separated list of integers") from None

    def check(self, key: str, value: Any) -> tuple[int, ...]:
        if not isinstance(value, list | tuple) or any(
            not isinstance(v, int) or isinstance(v, bool) for v in value
        ):
            raise ValueError(f"{key} must be {self.what}{self.hint}, got {value!r}")
        return tuple(value)


@dataclass(frozen=True)
class JsonObject(Kind):
    """Checked whole by the setting's reader (e.g. TrafficShape.from_dict), which knows its fields."""

    what = "a JSON object"

    def check(self, key: str, value: Any) -> Any:
        return value
