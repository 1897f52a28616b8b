"""The benchmark's four grammar groups ask what their names say, the same prompts every run."""

from __future__ import annotations

from benchmarks.prompt_following import GRAMMAR_GROUPS, correct_without_place, grammar_prompts
from benchmarks.prompt_judge import Reading
from deploy.checkpoints import demo_scenes, prompt_grammar


def test_each_group_draws_its_pairs_in_its_patterns_and_the_same_prompts_every_run():
    assert list(GRAMMAR_GROUPS) == ["trained_wordings", "held_out_wordings", "held_out_pairs", "no_place"]
    for group, (pairs, patterns) in GRAMMAR_GROUPS.items():
        prompts = grammar_prompts(group, 40)
        assert prompts == grammar_prompts(group, 40) and len({p for p, _ in prompts}) == 40
        assert all(asked.held_out == (pairs == "held_out") for _, asked in prompts), group
        assert all((p in prompt_grammar.HELD_OUT_PATTERNS) == (group == "held_out_wordings") for p in patterns)
        assert all(p.place == (group != "no_place") for p in patterns), group


def test_a_prompt_without_a_place_is_right_in_any_quarter():
    asked = demo_scenes.Attributes("circle", "red", "blue", "top", "left")
    hits = correct_without_place(Reading("circle", "red", "blue", "bottom", "right"), asked)
    assert hits == {"shape": True, "colour": True, "background": True, "all": True}
    assert not correct_without_place(Reading("square", "red", "blue", "top", "left"), asked)["all"]
