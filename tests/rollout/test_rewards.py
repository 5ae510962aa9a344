import pytest
import torch

from SPA_agent.rollout.rewards import normalize_scores

SCORES = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0])
GROUPS = [0, 0, 1, 1, 2]


def test_identity_returns_a_copy():
    out = normalize_scores(SCORES, GROUPS, "identity")
    torch.testing.assert_close(out, SCORES)
    assert out.data_ptr() != SCORES.data_ptr()


def test_mean_centers_each_group():
    torch.testing.assert_close(normalize_scores(SCORES, GROUPS, "mean"), torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0]))


def test_mean_std_uses_unbiased_std_and_zeros_constant_groups():
    out = normalize_scores(SCORES, GROUPS, "mean_std")
    std = torch.tensor([1.0, 3.0]).std()  # sqrt(2)
    expected = torch.tensor([-1.0 / (std + 1e-6), 1.0 / (std + 1e-6), 0.0, 0.0, 0.0])
    torch.testing.assert_close(out, expected)


def test_asym_clip_clamps_to_minus_one_three():
    high = torch.tensor([0.0] * 15 + [1.0])  # the outlier's z-score is 15 / 4 = 3.75
    low = -high
    assert normalize_scores(high, [0] * 16, "asym_clip").max().item() == 3.0
    assert normalize_scores(low, [0] * 16, "asym_clip").min().item() == -1.0


def test_unknown_method_is_a_clear_error():
    with pytest.raises(ValueError, match="mean_std"):
        normalize_scores(SCORES, GROUPS, "zscore")
