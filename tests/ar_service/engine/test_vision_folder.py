"""ar_service/engine/vision_folder.py: one folder of links to the encoder's files and its processor's, gone after."""

from __future__ import annotations

from pathlib import Path

from ar_service.engine.vision_folder import linked_folder


def test_the_linked_folder_holds_each_parts_files_and_is_removed_by_its_cleanup(tmp_path):
    weights, processor = tmp_path / "text_encoder", tmp_path / "processor"
    for part, name in ((weights, "config.json"), (processor, "preprocessor_config.json")):
        part.mkdir()
        (part / name).write_text(part.name)
    folder = linked_folder(weights, processor)
    served = Path(folder.name)
    assert sorted(p.name for p in served.iterdir()) == ["config.json", "preprocessor_config.json"]
    assert (served / "config.json").read_text() == "text_encoder"
    folder.cleanup()
    assert not served.exists() and (weights / "config.json").exists()
