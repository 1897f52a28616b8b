"""dit_service/shared_vae.py: a pipeline that encodes its own pictures does so under the shared VAE's lock, and
reads every other attribute of the VAE as it is."""

from __future__ import annotations

import threading

import torch

from dit_service.shared_vae import SharedVae


class Vae(torch.nn.Module):
    """Stands in for a diffusers VAE: a parameter, a config, an ``encode`` that says it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        self.config = {"z_dim": 16}
        self.temperal_downsample = [False, True, True]
        self.encoded = threading.Event()

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        self.encoded.set()
        return pixels + 1


def test_an_encode_waits_for_the_shared_lock_and_then_runs_on_the_shared_vae():
    vae = Vae()
    shared = SharedVae(vae, 8)
    seen = shared.encoding_under_lock()
    results: list[torch.Tensor] = []
    with shared.lock:
        encoding = threading.Thread(target=lambda: results.append(seen.encode(torch.zeros(1))))
        encoding.start()
        assert not vae.encoded.wait(timeout=0.5)  # a hang guard's worth: it must not run while the lock is held
    encoding.join(timeout=60)
    assert vae.encoded.is_set() and torch.equal(results[0], torch.ones(1))


def test_every_other_attribute_is_the_vaes_own():
    vae = Vae()
    seen = SharedVae(vae, 8).encoding_under_lock()
    assert seen.config is vae.config and seen.temperal_downsample is vae.temperal_downsample
    assert next(seen.parameters()) is vae.weight  # the pipeline finds the VAE's device and dtype
