"""The replica's link (runtime/link.py) against a real outer-optimiser driver actor: a link that
encodes pseudo-gradients on the training device (``core.staging``, as a GPU worker's does)
sends the bits of one that encodes them on the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_diloco.config import load_config
from ray_diloco.core.staging import DeviceStaging
from ray_diloco.core.sync import SyncBuffers
from ray_diloco.runtime.link import Link

SIZES = [1001, 70_000]


def _rounds(ray, cfg, mirror: bool):
    """Three rounds of two fragments for replicas 0 and 1 through their links; returns every
    new global value each replica received, the links' residuals and whether values were staged."""
    from ray_diloco.runtime.driver import OuterDriverActor

    rng = np.random.default_rng(0)
    theta = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
    driver = OuterDriverActor.remote(None, cfg.to_dict())
    ray.get(driver.init_global.remote([ray.put(t) for t in theta]))
    s = cfg.streaming
    links = [Link(driver, m, 0, s.quantization, s.error_feedback, shards=cfg.diloco.outer_shards,
                  buffers=SyncBuffers(), staging=DeviceStaging("cpu", mirror=True) if mirror else None)
             for m in range(2)]
    held = [[torch.from_numpy(t.copy()) for t in theta] for _ in range(2)]
    received, staged = [], []
    for k, step in enumerate((5, 10, 15)):
        for f, n in enumerate(SIZES):
            futures = []
            for m, link in enumerate(links):
                d = torch.from_numpy(np.random.default_rng(100 * step + 10 * f + m).standard_normal(n).astype(np.float32))
                if mirror:  # a "device" tensor, handed off as FragmentSync does
                    futures.append(link.exchange(f, step, 1.0 + m, d, held[m][f], k, ready=link.staging.hand_off(d)))
                else:  # into a host buffer, as FragmentSync does without staging
                    futures.append(link.exchange(f, step, 1.0 + m, link.buffers.take(n).copy_(d), held[m][f], k))
            for m, fut in enumerate(futures):
                res = fut.result(timeout=60)
                assert res.status == "ok" and res.version == k + 1
                held[m][f] = res.new_global.clone()
                received.append(res.new_global.clone())
                staged.append(res.staged is not None and torch.equal(res.staged, res.new_global))
    residuals = [link.residual_state() for link in links]
    for link in links:
        link.close()
    ray.kill(driver)
    return received, residuals, staged


@pytest.mark.parametrize("fmt,shards", [("none", 1), ("int8", 2)])
def test_a_link_encoding_on_the_device_sends_the_bits_of_the_host(ray_session, fmt, shards):
    """With error feedback and K outer shards: the new global values and the residuals are bit for
    bit those of the host path, and every new global value came back staged on the device."""
    cfg = load_config({"diloco": {"outer_shards": shards}, "streaming": {"quantization": fmt, "error_feedback": True}})
    host, host_res, host_staged = _rounds(ray_session, cfg, mirror=False)
    dev, dev_res, dev_staged = _rounds(ray_session, cfg, mirror=True)
    assert len(host) == len(dev) == 12
    assert all(torch.equal(a, b) for a, b in zip(host, dev))
    assert not any(host_staged) and all(dev_staged)
    for a, b in zip(host_res, dev_res):
        assert a.keys() == b.keys() and all(np.array_equal(a[f], b[f]) for f in a)
    assert fmt == "none" or all(len(r) == 2 for r in dev_res)  # quantised: a residual per fragment
