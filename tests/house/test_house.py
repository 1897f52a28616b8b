"""The house keeps itself: no import circle among the product's modules, no product function over 60 lines,
no test that sleeps a fixed fraction of a second where it could wait for what it means (the allowlist names
each that stays, with its reason). The scans are shown to catch what they look for."""

from __future__ import annotations

import ast
import textwrap

from tests.house.allowed_sleeps import ALLOWED
from tests.house.scans import (
    ROOT,
    circle_path,
    circles,
    fixed_sleeps,
    functions,
    import_graph,
    imported,
    product_functions,
    sleeps_in_tests,
)

MOST_LINES = 60


def test_no_product_modules_import_each_other_in_a_circle():
    graph = import_graph()
    found = [f"{', '.join(circle)}: {circle_path(graph, circle)}" for circle in circles(graph)]
    assert found == [], "modules that import each other, round and round:\n" + "\n".join(found)


def test_no_product_function_is_over_60_lines():
    long = [str(function) for function in product_functions() if function.lines > MOST_LINES]
    assert long == [], f"functions over {MOST_LINES} lines:\n" + "\n".join(long)


def test_no_test_sleeps_a_fixed_fraction_of_a_second_unless_the_allowlist_says_why():
    unexplained = [str(sleep) for sleep in sleeps_in_tests() if sleep.key not in ALLOWED]
    assert unexplained == [], (
        "fixed sleeps under a second: wait for what the sleep stands for (tests/support/waiting.py), or, where "
        "time passing is what the test is about, add the line to tests/house/allowed_sleeps.py with why:\n"
        + "\n".join(unexplained)
    )


def test_every_allowed_sleep_is_still_there_and_has_a_reason():
    present = {sleep.key for sleep in sleeps_in_tests()}
    assert [key for key in ALLOWED if key not in present] == [], "entries whose sleep is gone: remove them"
    assert all(len(reason) > 20 for reason in ALLOWED.values())


# The scans themselves, on planted sources.

PLANTED = textwrap.dedent(
    """
    import asyncio, time
    from anyio import sleep as nap

    def test_waits():
        time.sleep(0.2)  # all accepted
        time.sleep(2)
        time.sleep(0)
        time.sleep(SECONDS)

    class TestSome:
        async def test_in_a_class(self):
            async def inner():
                await asyncio.sleep(delay=0.05)
            await nap(0.5)
            await asyncio.sleep(0)
    """
)


def test_the_sleep_scan_catches_literal_sub_second_sleeps_by_any_import_and_names_where_they_are():
    found = [(s.function, s.code, s.line) for s in fixed_sleeps(PLANTED, "tests/planted.py")]
    assert found == [
        ("test_waits", "time.sleep(0.2)  # all accepted", 6),
        ("TestSome.test_in_a_class.inner", "await asyncio.sleep(delay=0.05)", 14),
        ("TestSome.test_in_a_class", "await nap(0.5)", 15),
    ]


def test_the_sleep_scans_key_is_the_file_function_and_line_not_the_line_number():
    moved = fixed_sleeps("\n\n" + PLANTED, "tests/planted.py")
    assert [s.key for s in moved] == [s.key for s in fixed_sleeps(PLANTED, "tests/planted.py")]
    assert moved[0].key == ("tests/planted.py", "test_waits", "time.sleep(0.2)  # all accepted")


def test_the_circle_scan_finds_a_planted_circle_through_type_imports_and_relative_ones():
    sources = {
        "p.a": "from p.b import B",
        "p.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c",
        "p.c": "import p.a",
        "p.d": "from p import a",  # p.a, a module: d imports the circle, nothing in it imports d
    }
    graph = {name: imported(ast.parse(code), name, False, sources) for name, code in sources.items()}
    assert graph["p.d"] == {"p.a"} and graph["p.b"] == {"p.c"}
    assert circles(graph) == [["p.a", "p.b", "p.c"]]
    assert circle_path(graph, ["p.a", "p.b", "p.c"]) == "p.a → p.b → p.c → p.a"


def test_the_length_scan_counts_from_def_to_the_last_line_without_decorators_in_classes_and_nested():
    source = textwrap.dedent(
        """
        @decorated
        @twice
        def outer():
            def inner():
                return 1
            return inner

        class Kind:
            async def method(self):
                pass
        """
    )
    found = {(f.name, f.lines) for f in functions(ast.parse(source), ROOT / "planted.py")}
    assert found == {("outer", 4), ("outer.<locals>.inner", 2), ("Kind.method", 2)}
