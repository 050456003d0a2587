"""Sliding-window attention a chunk of queries at a time (`model.attention: chunks`): every
query in one chunk, every key its window reaches in that chunk's keys, and the result the dense
mask's to float rounding."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from relaytrain.model.config import PRESETS
from relaytrain.model.init import init_weights
from relaytrain.model.olmo3 import Olmo3, sliding_window_mask
from relaytrain.model.sliding_chunks import CHUNK, sliding_attention, spans

torch.set_num_threads(2)


def test_spans_cover_every_query_once_with_every_key_in_its_window():
    for t in range(1, 70, 3):
        for window in (1, 2, 5, 16, 40, 100):
            for chunk in (1, 4, 7, CHUNK):
                got = spans(t, window, chunk)
                queries = [q for s, e, _ in got for q in range(s, e)]
                assert queries == list(range(t)), (t, window, chunk)
                for s, e, first in got:
                    assert first == max(0, s - window + 1)  # no key before the first reachable
                    assert all(k >= first for q in range(s, e)
                               for k in range(max(0, q - window + 1), q + 1))


@pytest.mark.parametrize("t, window", [(70, 5), (70, 40), (33, 100)])  # < and > CHUNK, > T
def test_chunks_equal_the_dense_mask_to_rounding_forward_and_backward(t, window):
    gen = torch.Generator().manual_seed(t + window)
    q, k, v, g = (torch.randn(2, 3, t, 16, generator=gen) for _ in range(4))

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        out.backward(g)
        return out.detach(), *(x.grad for x in leaves)

    chunks = run(lambda a, b, c: sliding_attention(a, b, c, window, 0.25))
    dense = run(lambda a, b, c: F.scaled_dot_product_attention(
        a, b, c, attn_mask=sliding_window_mask(t, window, torch.device("cpu")), scale=0.25))
    for a, b in zip(chunks, dense, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_model_attends_in_chunks_as_with_the_dense_mask():
    """GQA (4 query heads on 2 kv heads), a window shorter than the sequence; under bf16
    autocast, which the chunks do not take, the dense mask runs instead."""
    cfg = PRESETS["tiny"].with_vocab(300)
    cfg = dataclasses.replace(cfg, n_heads=4, n_kv_heads=2)
    x = torch.randint(0, 300, (2, 50))
    out, grads = {}, {}
    for backend in ("sdpa", "chunks"):
        m = Olmo3(cfg)
        init_weights(m, 0)
        m.configure(attention=backend)
        logits = m(x)
        logits.square().mean().backward()
        out[backend] = logits.detach()
        grads[backend] = {n: p.grad for n, p in m.named_parameters()}
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            assert m(x).isfinite().all()
    assert cfg.sliding_window < x.shape[1]
    torch.testing.assert_close(out["chunks"], out["sdpa"], rtol=1e-5, atol=1e-5)
    for name, g in grads["sdpa"].items():
        torch.testing.assert_close(grads["chunks"][name], g, rtol=1e-4, atol=1e-6)
