"""The promotion rule: better than the champion by the margin AND faster than plain decoding."""

import pytest

from eagleray.platform.config.promotion import PromotionConfig
from eagleray.serve.promotion import Measurement, decide

CFG = PromotionConfig(candidate="models:/d/2", min_tau_gain=0.05, min_speedup=1.0)
PLAIN = Measurement("plain", None, tokens=900, seconds=10.0)  # 90 tok/s


def _m(tau, tps):
    return Measurement("x", "d/1", tokens=int(tps * 10), seconds=10.0, tau=tau, accept_rate_per_pos=[0.5])


@pytest.mark.parametrize(
    "cand, champ, promote, why",
    [
        (_m(2.5, 120), _m(2.1, 100), True, "vs champion"),
        (_m(2.15, 120), _m(2.1, 100), False, "not 5% above"),  # better, but not by the margin
        (_m(2.5, 82), _m(2.1, 100), False, "plain decoding"),  # the story: τ 2.1 and still slower (82 vs 90 tok/s)
        (_m(2.5, 120), None, True, "no champion"),
        (_m(1.0, 80), None, False, "plain decoding"),
    ],
)
def test_decide(cand, champ, promote, why):
    d = decide(cand, champ, PLAIN, CFG)
    assert d.promote is promote and why in d.reason
    assert d.speedup == pytest.approx(cand.tokens_per_s / 90.0)
