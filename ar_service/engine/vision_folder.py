"""The folder vLLM serves a picture-reading text encoder from: the encoder's files and its processor's, side by side.

vLLM reads a model's processor (image processor, tokenizer, chat template) from the model's own folder (``model=``);
a published pipeline keeps them apart, in ``text_encoder/`` and ``processor/``. The AR links both into one temporary
folder for the engine's life: links, not copies (a real encoder's weights are gigabytes), made at each start and
removed at shutdown. ``TextModel.read`` has checked that no file name is in both.
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def linked_folder(*parts: Path) -> tempfile.TemporaryDirectory[str]:
    """A temporary folder holding a link to every file of each of ``parts``; removed by its ``cleanup``."""
    folder = tempfile.TemporaryDirectory(prefix="ardit-encoder-")
    for part in parts:
        for source in part.iterdir():
            (Path(folder.name) / source.name).symlink_to(source.resolve())
    return folder
