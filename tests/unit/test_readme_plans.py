"""The planner tables in README.md and the recipes' READMEs are what `aligner plan` prints today.

A table is a ```text block whose first line is `$ aligner plan ...`; `$(grep -Ev '...' FILE)` in it stands
for FILE's overrides (one a line, comments and blank lines skipped), as a shell expands it. After a change
to the planner, `python -m tests.unit.test_readme_plans` rewrites every block with the current output."""
import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

BLOCK = re.compile(r"```text\n(\$ aligner plan [^\n]*)\n(.*?)```", re.S)
OVERRIDES_FILE = re.compile(r"\$\(grep -Ev '[^']*' ([^)\s]+)\)")
READMES = [REPO / "README.md", *sorted((REPO / "examples").glob("*/README.md"))]


def overrides(path: str) -> str:
    lines = (REPO / path).read_text().splitlines()
    return " ".join(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))


def plan_output(command: str) -> tuple[int, str]:
    """What `command` ($ aligner plan ...) prints, run in this process."""
    from aligner.plan.cli import main

    argv = shlex.split(OVERRIDES_FILE.sub(lambda m: overrides(m.group(1)), command.removeprefix("$ ")))[2:]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def blocks() -> list[tuple[Path, str, str]]:
    return [(readme, m.group(1), m.group(2)) for readme in READMES for m in BLOCK.finditer(readme.read_text())]


def test_the_readmes_show_the_plans_the_issue_asks_for():
    commands = " ".join(command for _, command, _ in blocks())
    for needed in ("llama3_70b_ppo/ppo.overrides", "llama31_405b_sft_dpo/sft.overrides",
                   "llama31_405b_sft_dpo/dpo.overrides", "llama3_8b_sft_dpo/sft.overrides", "cluster.gpu=cpu"):
        assert needed in commands, needed


@pytest.mark.parametrize("readme,command,shown", blocks(), ids=lambda v: v.name if isinstance(v, Path) else None)
def test_a_readme_plan_is_the_planners_output(readme, command, shown):
    code, printed = plan_output(command)
    assert code == 0, printed  # every layout shown in a README fits
    assert printed.strip() == shown.strip(), f"{readme}: rerun `python -m tests.unit.test_readme_plans`"


def rewrite() -> None:
    for readme in READMES:
        text = readme.read_text()
        new = BLOCK.sub(lambda m: f"```text\n{m.group(1)}\n{plan_output(m.group(1))[1].rstrip()}\n```", text)
        if new != text:
            readme.write_text(new)
            print(f"updated {readme}", file=sys.stderr)


if __name__ == "__main__":
    rewrite()
