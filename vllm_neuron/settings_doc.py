"""docs/configuration.md's table of settings, written from vllm_neuron/settings.py.

`make settings-doc` (`python -m vllm_neuron.settings_doc --write-doc docs/configuration.md`) rewrites the
part of the doc between BEGIN and END; tests/unit/test_settings.py fails while the doc differs from it.
"""

import argparse
import re
from pathlib import Path

from vllm_neuron.settings import SETTINGS, Setting

BEGIN = "<!-- settings table: written by `make settings-doc` from vllm_neuron/settings.py; do not edit -->"
END = "<!-- end of the settings table -->"
HEADER = (
    "| variable | `serve` flag | `--additional-config` key | takes | default | meaning | read in |\n"
    "|---|---|---|---|---|---|---|"
)
# A doc named in a meaning ("docs/buckets.md#anchor") becomes a link relative to docs/.
_DOC_REFERENCE = re.compile(r"docs/([\w-]+\.md)(#[\w-]+)?")


def _code(text: str | None) -> str:
    return f"`{text}`" if text else ""


def _default(setting: Setting) -> str:
    if setting.shown_default is not None:
        return setting.shown_default
    if isinstance(setting.default, bool):
        return f"`{int(setting.default)}`"
    return _code(str(setting.default)) if setting.default not in (None, "") else "unset"


def _cell(text: str) -> str:
    linked = _DOC_REFERENCE.sub(lambda m: f"[{m[1]}]({m[1]}{m[2] or ''})", text)
    return linked.replace("|", "\\|")


def _flag(setting: Setting) -> str:
    if setting.flag is None:
        return ""
    return _code(f"{setting.flag} {setting.metavar}" if setting.metavar else setting.flag)


def table() -> str:
    rows = [
        f"| {_code(s.env)} | {_flag(s)} | {_code(s.key)} | {_cell(s.kind.what)} | {_cell(_default(s))} "
        f"| {_cell(s.meaning)} | {_code(s.read_in)} |"
        for s in SETTINGS
    ]
    return "\n".join([HEADER, *rows])


def with_table(doc: str) -> str:
    """`doc` with the part between BEGIN and END replaced by the current table."""
    before, begin, rest = doc.partition(BEGIN)
    _, end, after = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"the doc has no {BEGIN!r} ... {END!r} markers")
    return f"{before}{BEGIN}\n{table()}\n{END}{after}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write-doc", type=Path, required=True, help="the markdown file to rewrite")
    path = parser.parse_args(argv).write_doc
    path.write_text(with_table(path.read_text()))


if __name__ == "__main__":
    main()
