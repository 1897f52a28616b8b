"""Fails at once when the Python that would make .venv is not one pyproject.toml's requires-python allows.

Runs before the venv exists, under whatever `python3` the machine has: plain syntax only (no f-strings,
no tomllib), so an old interpreter reaches the message instead of a SyntaxError.
"""

import operator
import os
import re
import sys

PYPROJECT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "pyproject.toml")
COMPARE = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
    "==": operator.eq,
    "!=": operator.ne,
}


def requires_python():
    with open(PYPROJECT) as f:
        found = re.search(r'^requires-python\s*=\s*"([^"]+)"', f.read(), re.MULTILINE)
    assert found is not None, "pyproject.toml has no requires-python"
    return found.group(1)


def allows(spec, version):
    for clause in spec.split(","):
        parsed = re.match(r"\s*(>=|<=|==|!=|>|<)\s*([\d.]+)\s*$", clause)
        assert parsed is not None, "unsupported requires-python clause: " + clause
        op, number = parsed.groups()
        wanted = tuple(int(part) for part in number.split("."))
        if not COMPARE[op](version[: len(wanted)], wanted):
            return False
    return True


def main():
    spec = requires_python()
    if allows(spec, tuple(sys.version_info[:3])):
        return 0
    lowest = re.search(r">=\s*([\d.]+)", spec)
    use = "python" + lowest.group(1) if lowest else "a Python that matches " + spec
    found = ".".join(str(part) for part in sys.version_info[:3])
    # %-formatting and no unpacking: this must run on whatever old Python the machine has.
    sys.stderr.write(
        "ardit needs Python %s (pyproject.toml requires-python); %s is %s.\n"  # noqa: UP031
        "Install %s (Debian/Ubuntu: apt-get install %s %s-venv; or pyenv/uv), then run make again, "
        "or point make at it: make PYTHON=/path/to/%s ...\n" % (spec, sys.executable, found, use, use, use, use)
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
