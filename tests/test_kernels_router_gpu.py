"""The one-launch router tail (dsv4/kernels/router.py) against dsv4.moe.Router's plain-MLX ops
(run on the H200: pytest -m gpu).

Ids are compared as sets (the plain-MLX partition lists them in no defined order, the kernel in
descending key order) and the weights id by id. Tolerance on the weights: 2e-6 relative (~16
fp32 ulps): exp, log and sqrt may each differ by an ulp or two between the paths (the kernel's
log1p is built from log), and the normalising sum adds its terms in another order."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.kernels import router
from dsv4.kernels.dialect import backend, poisoned_outputs
from dsv4.moe import Router

pytestmark = pytest.mark.gpu


def make_router(rng, experts, hidden, k, norm, temp=1.0, bias_scale=0.0):
    args = SimpleNamespace(n_routed_experts=experts, hidden_size=hidden, num_experts_per_tok=k,
                           gate_temp=temp, norm_topk_prob=norm, routed_scaling_factor=1.5)
    r = Router(args)
    r.weight = mx.array(rng.standard_normal((experts, hidden)).astype(np.float32) / np.sqrt(hidden)).astype(mx.bfloat16)
    r.bias = mx.array(rng.standard_normal(experts).astype(np.float32) * bias_scale)
    return r


def by_id(ids, weights):
    ids, weights = np.array(ids), np.array(weights)
    order = np.argsort(ids, axis=-1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


@pytest.mark.parametrize("experts,hidden,k,tokens,norm,temp,bias_scale", [
    (384, 5120, 6, 1, True, 1.0, 0.1),     # V4.1 Flash
    (384, 5120, 6, 8, True, 1.0, 0.1),
    (256, 512, 8, 3, True, 0.7, 1.0),      # the bias decides the selection
    (13, 64, 1, 5, False, 1.0, 0.0),       # odd expert count, k = 1, no normalisation
])
def test_router_kernel_matches_the_plain_ops(experts, hidden, k, tokens, norm, temp, bias_scale):
    assert backend() is not None, "needs MLX's CUDA or Metal backend"
    rng = np.random.default_rng()
    r = make_router(rng, experts, hidden, k, norm, temp, bias_scale)
    x = mx.array(rng.standard_normal((tokens, hidden)).astype(np.float32) * 3).astype(mx.bfloat16)
    assert router.kernel_applies(mx.zeros((tokens, experts)), k)
    with poisoned_outputs():
        got = by_id(*r(x))
    with flags.override(kernel_router=False):
        want = by_id(*r(x))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=2e-6, atol=0)


def test_ties_go_to_the_lower_expert_id():
    """Equal keys everywhere (zero gate weight, zero bias): the k lowest ids win."""
    r = make_router(np.random.default_rng(0), 64, 32, 6, True)
    r.weight = mx.zeros((64, 32), mx.bfloat16)
    x = mx.ones((2, 32), mx.bfloat16)
    with poisoned_outputs():
        ids, weights = r(x)
    assert sorted(np.array(ids)[0].tolist()) == list(range(6))
    assert sorted(np.array(ids)[1].tolist()) == list(range(6))
    np.testing.assert_allclose(np.array(weights), 1.5 / 6, rtol=1e-6)
