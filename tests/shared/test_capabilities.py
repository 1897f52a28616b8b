"""A DiT's announced limits: merged across replicas field by field, and checked against a request."""

from __future__ import annotations

import pytest

from shared.capabilities import DiffusionLimits, DitCapabilities
from shared.diffusion import MAX_SEED, DiffusionParams, FirstBlockCache, TaylorSeerCache
from shared.errors import InvalidDiffusionParams
from shared.frames import EditSpec, PictureSpec
from tests.support.capabilities import DIT

LIMITS = DIT.limits


def params(**overrides) -> DiffusionParams:
    return DiffusionParams(
        **{"width": 64, "height": 48, "num_inference_steps": 12, "guidance_scale": 1.0, "seed": 0} | overrides
    )


def test_the_common_limits_are_what_every_dit_can_do_each_field_by_its_own_rule():
    other = LIMITS.model_copy(
        update={
            "size_multiple": 24,
            "max_pixels": 4096,
            "min_inference_steps": 4,
            "max_inference_steps": 50,
            "max_guidance_scale": 12.0,
            "max_images": 1,
            "max_conditioning_rows": 128,
            "output_formats": ["jpeg", "webp"],
            "step_caches": ["taylorseer"],
        }
    )
    common = DiffusionLimits.common([LIMITS, other])
    assert common == DiffusionLimits(
        size_multiple=48,  # a multiple of both
        max_pixels=4096,
        min_inference_steps=4,
        max_inference_steps=40,
        max_guidance_scale=10.0,
        max_images=1,
        max_conditioning_rows=64,
        output_formats=["jpeg"],
        step_caches=["taylorseer"],
    )


def test_every_limit_field_declares_how_it_merges():
    assert all(any(callable(m) for m in field.metadata) for field in DiffusionLimits.model_fields.values())


def test_dits_that_agree_announce_themselves_and_others_the_tightest_limits():
    assert DitCapabilities.common([DIT, DIT]) is DIT
    tighter = DIT.model_copy(update={"limits": LIMITS.model_copy(update={"max_images": 1})})
    common = DitCapabilities.common([DIT, tighter])
    assert common.limits.max_images == 1 and common.model == DIT.model and common.defaults == DIT.defaults


def test_a_request_within_the_limits_passes():
    LIMITS.check(params())
    LIMITS.check(params(width=256, height=256, num_inference_steps=40, num_images=4, guidance_scale=10.0))


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        ({"width": 40}, "size"),
        ({"width": 512, "height": 512}, "size"),
        ({"num_inference_steps": 1}, "num_inference_steps"),
        ({"num_inference_steps": 41}, "num_inference_steps"),
        ({"num_images": 5}, "n"),
        ({"seed": MAX_SEED, "num_images": 2}, "seed"),
        ({"guidance_scale": 10.5}, "guidance_scale"),
        ({"guidance_scale": float("inf")}, "guidance_scale"),
        ({"output_format": "webp"}, "output_format"),
    ],
)
def test_what_the_dit_cannot_render_exactly_is_refused_naming_the_public_parameter(overrides, param):
    with pytest.raises(InvalidDiffusionParams) as refused:
        LIMITS.check(params(**overrides))
    assert refused.value.param == param and refused.value.status == 422


def test_a_custom_schedule_is_checked_against_the_step_limits_naming_sigmas():
    with pytest.raises(InvalidDiffusionParams) as refused:
        LIMITS.check(params(num_inference_steps=1, sigmas=[0.5]))
    assert refused.value.param == "sigmas"
    LIMITS.check(params(num_inference_steps=3, sigmas=[1.0, 0.6, 0.2]))


def test_a_step_cache_the_dit_does_not_run_is_refused_naming_step_cache():
    taylorseer = TaylorSeerCache(method="taylorseer", interval=3)
    LIMITS.check(params(step_cache=taylorseer))
    only_first_block = LIMITS.model_copy(update={"step_caches": ["first_block"]})
    only_first_block.check(params(step_cache=FirstBlockCache(method="first_block", threshold=0.1)))
    with pytest.raises(InvalidDiffusionParams) as info:
        only_first_block.check(params(step_cache=taylorseer))
    assert info.value.param == "step_cache" and "first_block" in str(info.value)


def test_a_dit_that_predates_step_caches_announces_none():
    announced = LIMITS.model_dump(mode="json")
    del announced["step_caches"]
    assert DiffusionLimits.model_validate(announced).step_caches == []


# What a reference-edit DiT announces (Qwen-Image-Edit's card): up to three pictures, no mask, no strength, nothing
# from text alone.
REFERENCE_EDITS = LIMITS.model_copy(
    update={"text_to_image": False, "max_edit_pictures": 3, "edit_mask": False, "edit_strength": False}
)
NO_EDITS = LIMITS.model_copy(
    update={"edits": False, "max_edit_pictures": 0, "edit_mask": False, "edit_strength": False}
)


def edit(pictures: int = 1, strength: float | None = 0.5, mask: bool = False) -> EditSpec:
    return EditSpec(pictures=[PictureSpec(width=64, height=48)] * pictures, strength=strength, mask=mask)


def test_a_dit_that_predates_the_edit_facts_draws_as_qwen_image_does():
    announced = LIMITS.model_dump(mode="json")
    for name in ("text_to_image", "max_edit_pictures", "edit_mask", "edit_strength"):
        del announced[name]
    limits = DiffusionLimits.model_validate(announced)
    assert (limits.text_to_image, limits.max_edit_pictures, limits.edit_mask, limits.edit_strength) == (
        True,
        1,
        True,
        True,
    )
    for asked in (None, edit(), edit(mask=True)):
        limits.check_edit(asked)


def test_a_reference_edit_dit_takes_up_to_its_pictures_without_a_strength():
    for pictures in (1, 3):
        REFERENCE_EDITS.check_edit(edit(pictures, strength=None))


@pytest.mark.parametrize(
    ("limits", "asked", "param"),
    [
        (REFERENCE_EDITS, None, "image"),
        (REFERENCE_EDITS, edit(4, strength=None), "image"),
        (REFERENCE_EDITS, edit(1, strength=0.5), "strength"),
        (REFERENCE_EDITS, edit(1, strength=None, mask=True), "mask"),
        (LIMITS, edit(2), "image"),
        (LIMITS, edit(1, strength=None), "strength"),
        (NO_EDITS, edit(), "image"),
    ],
    ids=[
        "text-alone-to-an-edit-model",
        "more-pictures-than-it-reads",
        "a-strength-to-a-reference-edit",
        "a-mask-without-inpaint",
        "two-pictures-to-img2img",
        "img2img-without-a-strength",
        "an-edit-to-a-text-model",
    ],
)
def test_an_edit_the_dit_cannot_draw_is_refused_naming_the_public_parameter(limits, asked, param):
    with pytest.raises(InvalidDiffusionParams) as refused:
        limits.check_edit(asked)
    assert refused.value.param == param and refused.value.status == 422


def test_a_dit_whose_pipeline_reads_the_pictures_takes_a_strength_only_with_a_mask_and_pictures_it_can_read():
    """FLUX.2 [klein]: reference edits take no strength, its inpaint does; a picture its pipeline refuses is refused."""
    from shared.diffusion import ReferencePictureRules

    rules = ReferencePictureRules(max_pictures=4, min_side=64, max_aspect=8, max_area=1024 * 1024, multiple=16)
    flux2 = LIMITS.model_copy(
        update={"max_edit_pictures": 4, "edit_mask": True, "edit_strength": False, "reference_pictures": rules}
    )

    def square(pictures: int, strength: float | None, mask: bool = False) -> EditSpec:
        return EditSpec(pictures=[PictureSpec(width=64, height=64)] * pictures, strength=strength, mask=mask)

    flux2.check_edit(square(4, None))
    flux2.check_edit(square(2, 0.5, mask=True))
    for asked in (square(1, 0.5), square(1, None, mask=True)):
        with pytest.raises(InvalidDiffusionParams) as refused:
            flux2.check_edit(asked)
        assert refused.value.param == "strength"
    small = EditSpec(pictures=[PictureSpec(width=64, height=64), PictureSpec(width=48, height=64)], strength=None)
    with pytest.raises(InvalidDiffusionParams) as refused:
        flux2.check_edit(small)
    assert refused.value.param == "image" and "picture 2" in str(refused.value)


def test_a_strength_that_runs_no_step_is_refused_only_where_the_pipeline_refuses_it():
    """Qwen-Image answers strength 0 with the input through its VAE; Z-Image's pipelines raise on a loop of no step."""
    LIMITS.check_edit_steps(0.0, 4)
    own_pipeline = LIMITS.model_copy(update={"edits_without_steps": False})
    own_pipeline.check_edit_steps(0.01, 4)  # diffusers' rounding runs one step of 4
    own_pipeline.check_edit_steps(None, 4)  # a reference edit runs every step
    with pytest.raises(InvalidDiffusionParams) as refused:
        own_pipeline.check_edit_steps(0.0, 4)
    assert refused.value.param == "strength" and "runs no step" in str(refused.value)
    assert DiffusionLimits.common([LIMITS, own_pipeline]).edits_without_steps is False


def test_dits_that_disagree_on_an_edits_strength_share_no_edit():
    common = DiffusionLimits.common([LIMITS, REFERENCE_EDITS])
    assert not common.edits and common.max_edit_pictures == 0 and not common.text_to_image
    with pytest.raises(InvalidDiffusionParams):
        common.check_edit(edit(1, strength=None))
    assert DiffusionLimits.common([REFERENCE_EDITS, REFERENCE_EDITS]) == REFERENCE_EDITS


SIZED = LIMITS.model_copy(update={"sizes": ["64x64", "128x64"]})


def test_a_dit_that_lists_its_sizes_draws_those_and_refuses_another_naming_them_as_openai_does():
    SIZED.check(params(width=128, height=64))
    with pytest.raises(InvalidDiffusionParams) as refused:
        SIZED.check(params(width=64, height=48))  # within the multiple and the pixel limit, but not listed
    assert refused.value.param == "size"
    assert refused.value.message == "Invalid value: '64x48'. Supported values are: '64x64', '128x64', and 'auto'."


def test_one_listed_size_is_named_with_auto_as_openai_names_two_values():
    one = LIMITS.model_copy(update={"sizes": ["64x64"]})
    with pytest.raises(
        InvalidDiffusionParams, match=r"^Invalid value: '128x128'. Supported values are: '64x64' and 'auto'.$"
    ):
        one.check_size(128, 128)


def test_a_dit_that_lists_no_sizes_draws_any_within_its_limits():
    assert LIMITS.sizes is None
    LIMITS.check(params(width=64, height=48))
    LIMITS.check(params(width=256, height=256))


def test_listed_sizes_merge_to_those_every_listing_dit_draws_and_a_dit_that_lists_none_takes_any():
    other = LIMITS.model_copy(update={"sizes": ["128x64", "64x128"]})
    assert DiffusionLimits.common([SIZED, other]).sizes == ["128x64"]
    assert DiffusionLimits.common([SIZED, LIMITS]).sizes == SIZED.sizes
    assert DiffusionLimits.common([LIMITS, LIMITS]).sizes is None


def test_dits_that_list_other_sizes_draw_auto_at_the_first_size_they_all_draw():
    first = DIT.model_copy(update={"limits": LIMITS.model_copy(update={"sizes": ["64x48", "128x64"]})})
    second = DIT.model_copy(update={"limits": LIMITS.model_copy(update={"sizes": ["128x64"]})})
    common = DitCapabilities.common([first, second])
    assert common.limits.sizes == ["128x64"] and (common.defaults.width, common.defaults.height) == (128, 64)
    assert DitCapabilities.common([first, first.model_copy(update={"description": "b"})]).defaults == DIT.defaults


def test_dits_that_share_no_size_refuse_every_size_saying_so():
    apart = DiffusionLimits.common([SIZED, LIMITS.model_copy(update={"sizes": ["64x128"]})])
    assert apart.sizes == []
    with pytest.raises(InvalidDiffusionParams, match="share no size"):
        apart.check_size(64, 64)


def test_the_size_limits_still_hold_for_a_listed_size():
    wrong = LIMITS.model_copy(update={"sizes": ["1024x1024"]})
    with pytest.raises(InvalidDiffusionParams, match="pixel limit"):
        wrong.check_size(1024, 1024)
