"""dit_service/open_frame_policy.py: an ``open`` whose rows are read otherwise than the model's card says (any field of
its recipe: other layers, the other side of the final norm, another template, another adapter) is refused before any
row is sent, naming the field; a card that names no recipe takes rows of any one layer. An edit the family cannot
draw, or text alone to a family that draws from pictures only, is refused there too."""

from __future__ import annotations

import pytest
import torch

from dit_service.conditioning import ConditioningAdapters, ConditioningOptions
from dit_service.open_frame_policy import OpenFramePolicy
from shared.errors import ConditioningMismatch, InvalidDiffusionParams
from shared.frames import EditSpec, OpenFrame, PictureSpec
from shared.row_recipe import QWEN_IMAGE_EDIT_TEMPLATE, RowRecipe
from tests.dit_service.handoff_requests import open_frame, params
from tests.support.capabilities import DIT

ADAPTERS = ConditioningAdapters(
    ConditioningOptions(
        special_token_ids=frozenset(),
        image_token_start_id=None,
        max_sequence_length=64,
        pad_to_multiple=1,
        dtype=torch.float32,
    )
)
FLUX2_ROWS = RowRecipe(
    layers=[9, 18, 27],
    final_norm=False,
    template=None,
    chat_template_kwargs={"enable_thinking": False},
    drops_template=False,
    conditioning="every_row",
)
# Qwen-Image-Edit's announcement: its recipe, and edits of up to three pictures without a strength, nothing from text.
EDIT_PLUS = DIT.model_copy(
    update={
        "rows": RowRecipe(layers=[30], template=QWEN_IMAGE_EDIT_TEMPLATE),
        "limits": DIT.limits.model_copy(
            update={"text_to_image": False, "max_edit_pictures": 3, "edit_mask": False, "edit_strength": False}
        ),
    }
)


def policy(rows: RowRecipe | None) -> OpenFramePolicy:
    return OpenFramePolicy(DIT.model_copy(update={"rows": rows}), ADAPTERS, expected_model=None)


def frame(rows: RowRecipe, edit: EditSpec | None = None) -> OpenFrame:
    return open_frame(4, diffusion=params(width=64, height=48), rows=rows, edit=edit)


def edit(pictures: int = 1, strength: float | None = None, mask: bool = False) -> EditSpec:
    return EditSpec(pictures=[PictureSpec(width=96, height=64)] * pictures, strength=strength, mask=mask)


def test_rows_read_by_the_cards_recipe_are_taken_with_its_adapter():
    assert policy(RowRecipe(layers=[8])).check(frame(RowRecipe(layers=[8]))) is ADAPTERS.get("qwen_image")
    assert policy(FLUX2_ROWS).check(frame(FLUX2_ROWS)) is ADAPTERS.get("every_row")


def test_rows_of_several_layers_the_card_names_are_taken_in_its_order_only():
    for layers in ([9, 18], [27, 18, 9], [9, 18, 27, 28]):
        with pytest.raises(ConditioningMismatch) as refused:
            policy(FLUX2_ROWS).check(frame(FLUX2_ROWS.model_copy(update={"layers": layers})))
        assert refused.value.param == "layers"


def test_rows_of_another_layer_are_a_conditioning_mismatch_naming_both_layers():
    with pytest.raises(ConditioningMismatch) as refused:
        policy(RowRecipe(layers=[8])).check(frame(RowRecipe(layers=[30])))
    assert refused.value.param == "layers"
    assert "[30]" in refused.value.message and "[8]" in refused.value.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("final_norm", False),
        ("template", None),
        ("chat_template_kwargs", {"enable_thinking": True}),
        ("drops_template", False),
        ("conditioning", "every_row"),
    ],
)
def test_rows_read_otherwise_in_any_field_of_the_recipe_are_a_conditioning_mismatch_naming_it(field, value):
    card = RowRecipe(layers=[8])
    with pytest.raises(ConditioningMismatch) as refused:
        policy(card).check(frame(card.model_copy(update={field: value})))
    assert refused.value.param == field and repr(value) in refused.value.message


def test_rows_for_an_adapter_the_dit_does_not_know_are_refused_naming_conditioning():
    with pytest.raises(ConditioningMismatch) as refused:
        policy(None).check(frame(RowRecipe(layers=[8], conditioning="another")))
    assert refused.value.param == "conditioning"


def test_an_open_guided_by_another_familys_rule_is_refused_naming_guidance_scale():
    zero = open_frame(4, diffusion=params(width=64, height=48, cfg_above=0.0), layers=(8,))
    with pytest.raises(InvalidDiffusionParams) as refused:
        policy(RowRecipe(layers=[8])).check(zero)
    assert refused.value.param == "guidance_scale" and "above 1.0" in refused.value.message


def test_a_card_that_names_no_recipe_takes_rows_of_any_one_layer_read_any_way_but_not_of_several():
    assert policy(None).check(frame(RowRecipe(layers=[30]))) is ADAPTERS.get("qwen_image")
    assert policy(None).check(frame(RowRecipe(layers=[3], final_norm=False, template=None))) is ADAPTERS.get(
        "qwen_image"
    )
    assert policy(None).check(frame(FLUX2_ROWS.model_copy(update={"layers": [9]}))) is ADAPTERS.get("every_row")
    with pytest.raises(ConditioningMismatch) as refused:
        policy(None).check(frame(RowRecipe(layers=[9, 18])))
    assert refused.value.param == "layers"


def test_a_reference_edit_model_takes_its_pictures_and_refuses_text_alone_a_strength_a_mask_or_a_fourth_picture():
    edit_plus, rows = OpenFramePolicy(EDIT_PLUS, ADAPTERS, expected_model=None), EDIT_PLUS.rows
    assert rows is not None
    for pictures in (1, 3):
        assert edit_plus.check(frame(rows, edit(pictures))) is ADAPTERS.get("qwen_image")
    refused_edits: list[tuple[str, EditSpec | None]] = [
        ("image", None),
        ("image", edit(4)),
        ("strength", edit(1, strength=0.5)),
        ("mask", edit(1, mask=True)),
    ]
    for param, refused_edit in refused_edits:
        with pytest.raises(InvalidDiffusionParams) as refused:
            edit_plus.check(frame(rows, refused_edit))
        assert refused.value.param == param


def test_an_img2img_model_takes_one_picture_with_a_strength_only():
    card = RowRecipe(layers=[8])
    policy(card).check(frame(card, edit(1, strength=0.5, mask=True)))
    for param, refused_edit in (("image", edit(2, strength=0.5)), ("strength", edit(1))):
        with pytest.raises(InvalidDiffusionParams) as refused:
            policy(card).check(frame(card, refused_edit))
        assert refused.value.param == param
