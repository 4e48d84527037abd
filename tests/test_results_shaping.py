"""``shape_vectors``: Matryoshka cut, then L2 normalisation, bit for bit what numpy's own
``np.linalg.norm`` gives (the lone-input path included)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from server.service.results import shape_vectors


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dimensions", [None, 7])
def test_shaped_vectors_are_numpys_normalised_rows(batch, dimensions):
    gen = torch.Generator().manual_seed(batch)
    pooled = [torch.randn(32, generator=gen) * 10 for _ in range(batch)]
    emb = np.stack([p.numpy() for p in pooled])[:, :dimensions]
    want = emb / np.maximum(np.linalg.norm(emb, axis=-1, keepdims=True), 1e-12)
    got = shape_vectors(pooled, dimensions=dimensions, normalize=True)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got, want)
    assert np.array_equal(shape_vectors(pooled, dimensions=dimensions, normalize=False), emb)


def test_a_zero_vector_stays_zero():
    assert not shape_vectors([torch.zeros(8)], dimensions=None, normalize=True).any()
