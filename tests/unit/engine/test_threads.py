"""The CPU engine's threads: inside a step torch's small ops run on one thread and the native kernels on
all of them; outside a step the process's settings are untouched."""

from __future__ import annotations

import pytest
import torch

from eagleray.kernels import cpu_decode, cpu_decode_build
from eagleray.serve.engine import SamplingParams

from .conftest import make_engine

native = pytest.mark.skipif(
    cpu_decode_build.unsupported() is not None, reason=f"native CPU kernels: {cpu_decode_build.unsupported()}"
)


@native
def test_a_step_uses_every_thread_and_leaves_the_settings_as_they_were(target, tokenizer):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = make_engine(target, tokenizer)
        assert engine.linear_backend == "native" and engine.threads.count == 2
        seen = []
        engine.add_request(
            "hello world",
            SamplingParams(max_tokens=3),
            on_output=lambda out: seen.append((torch.get_num_threads(), cpu_decode.threads())),
        )
        while engine.has_unfinished():
            engine.step()
        assert seen and all(s == (1, 2) for s in seen), "inside a step: torch on one thread, the kernels on two"
        assert torch.get_num_threads() == 2 and cpu_decode.threads() is None, "outside a step: untouched"
        with engine.threads.stepping():
            inner = make_engine(target, tokenizer)  # e.g. a hot-swap smoke test during a step
            with engine.threads.for_gemm():
                assert torch.get_num_threads() == 2, "prefill's GEMMs get torch's threads back"
            assert torch.get_num_threads() == 1
        assert inner.threads.count == 2
    finally:
        torch.set_num_threads(before)


def test_torch_backend_leaves_threads_alone(target, tokenizer):
    before = torch.get_num_threads()
    try:
        engine = make_engine(target, tokenizer, cpu_kernels="torch")
        engine.generate(["hello"], SamplingParams(max_tokens=2))
        assert engine.linear_backend == "torch (configured)" and torch.get_num_threads() == before
    finally:
        cpu_decode.configure("auto")


@native
def test_wide_forwards_inside_a_step_get_torch_threads_back(target, tokenizer, random_draft):
    """A verification of 30 sequences x (k=4 + 1) rows and the draft's catch-up over their prompts are past the
    native kernels' MAX_ROWS: their GEMMs are MKL's, on every thread (as a prefill's); narrow forwards keep one."""
    from .conftest import PROMPTS

    seen = {"target": [], "draft": [], "draft_logits": []}
    hooks = [
        layer.register_forward_pre_hook(lambda m, a, name=name: seen[name].append((a[0].shape[0], torch.get_num_threads())))
        for name, layer in (
            ("target", target.layers[0]),
            ("draft", random_draft.midlayer),
            ("draft_logits", random_draft.lm_head),
        )
    ]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = make_engine(target, tokenizer, random_draft, k=4, max_num_seqs=32)
        engine.generate((PROMPTS * 8)[:30], SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        torch.set_num_threads(before)
        for h in hooks:
            h.remove()
    wide = cpu_decode.MAX_ROWS
    assert (30 * 5, 2) in seen["target"], "the wide verification runs on both threads"
    assert any(rows > wide and n == 2 for rows, n in seen["draft"]), "the catch-up over the prompts too"
    assert all(n == 1 for rows, n in seen["draft"] if rows <= wide), "narrow draft forwards stay on one thread"
    # the catch-up's logits are its sequences' last rows: decode-sized, native (inside the wide context they went to
    # oneDNN, whose first use packed the 49k-vocab head: 0.5 s and another copy of its weight)
    assert seen["draft_logits"] and all(n == 1 for _, n in seen["draft_logits"])
