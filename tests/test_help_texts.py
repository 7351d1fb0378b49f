"""Every help text a user can read is finished: no raw argparse field (``%(default)s``) and no
reference to a file the repository does not have, in ``--help`` of every command (plugin
options included) and in ``irgen plugins``."""

from __future__ import annotations

import re
from pathlib import Path

from irgen.cli import build_parser, main
from irgen.plugins import PluginHost

ROOT = Path(__file__).resolve().parent.parent


def _texts(capsys) -> dict[str, str]:
    host = PluginHost().load()
    parser = build_parser(host)
    texts = {"irgen --help": parser.format_help()}
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sub in commands.choices.items():
        texts[f"irgen {name} --help"] = sub.format_help()
    capsys.readouterr()
    assert main(["plugins"]) == 0
    texts["irgen plugins"] = capsys.readouterr().out
    return texts


def test_no_raw_fields_and_no_dangling_files(capsys):
    texts = _texts(capsys)
    assert len(texts) > 8
    for where, text in texts.items():
        assert "%(" not in text, (where, text[text.index("%("):][:80])
        for ref in re.findall(r"[\w./-]+\.md\b", text):
            assert (ROOT / ref).is_file() or (ROOT / "docs" / Path(ref).name).is_file(), (where, ref)
