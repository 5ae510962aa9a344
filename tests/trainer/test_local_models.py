"""The local backend's log-prob/entropy head against verl's functions: values and gradients."""

from __future__ import annotations

import pytest
import torch
from verl.utils import torch_functional as verl_F

from SPA_agent.trainer.local_backend.models import _head_log_probs, _LogProbsAndEntropy


def _reference(head, hidden, targets, temperature, with_entropy):
    """verl's functions on the whole logits, as the local backend composed them before."""
    logits = head(hidden).float()[None] / temperature
    log_probs = verl_F.logprobs_from_logits(logits, targets[None])
    return torch.cat([log_probs, verl_F.entropy_from_logits(logits)]) if with_entropy else log_probs


@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_log_probs_and_gradients_equal_verls(with_entropy, temperature):
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False).double()
    with torch.no_grad():
        head.weight.copy_(torch.randn(300, 16, generator=gen, dtype=torch.float64) * 2)
    hidden = torch.randn(37, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 300, (37,), generator=gen)
    upstream = torch.randn(2 if with_entropy else 1, 37, generator=gen, dtype=torch.float64)

    results = []
    for fn in (_head_log_probs, _reference):
        head.zero_grad()
        hidden.grad = None
        out = fn(head, hidden, targets, temperature, with_entropy)
        (out.double() * upstream).sum().backward()
        results.append((out.detach(), hidden.grad.clone(), head.weight.grad.clone()))
    # both compute in float32 from the same logits; they differ in summation order only
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours.double(), theirs.double(), rtol=1e-4, atol=1e-4)


def test_closed_form_backward_passes_gradcheck():
    """The hand-written backward pass against finite differences, in float64."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(6, 11, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    targets = torch.randint(0, 11, (6,), generator=gen)
    assert torch.autograd.gradcheck(lambda z: _LogProbsAndEntropy.apply(z, targets), (logits,))


def test_entropy_of_a_uniform_row_is_log_vocab_and_of_a_one_hot_row_is_zero():
    head = torch.nn.Linear(2, 5, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0.0, 0.0]] * 4 + [[100.0, 0.0]]))
    hidden = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    out = _head_log_probs(head, hidden, torch.tensor([0, 4]), 1.0, with_entropy=True)
    torch.testing.assert_close(out, torch.tensor([[-torch.log(torch.tensor(5.0)), 0.0],
                                                  [torch.log(torch.tensor(5.0)), 0.0]]), atol=1e-6, rtol=0)
