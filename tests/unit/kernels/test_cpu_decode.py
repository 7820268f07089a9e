"""The native CPU linear kernel (kernels/cpu_decode.c) against torch.nn.functional.linear: values,
batch and thread invariance (what keeps greedy speculation lossless), the checked wrapper, dispatch
and the build/fallback rules."""

from __future__ import annotations

import pytest
import torch

from eagleray.kernels import cpu_decode, cpu_decode_build, cpu_gemm, cpu_panels
from eagleray.kernels.errors import KernelBuildError, KernelInputError

native = pytest.mark.skipif(
    cpu_decode_build.unsupported() is not None, reason=f"native CPU linear: {cpu_decode_build.unsupported()}"
)


@pytest.fixture
def fresh_state(monkeypatch):
    """Module state restored after the test (mode, library, threads)."""
    for name in ("_lib", "_mode", "_why_not", "_threads"):
        monkeypatch.setattr(cpu_decode, name, getattr(cpu_decode, name))
    yield


def _data(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)


@native
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 8, 13, 40, 64, 128])
@pytest.mark.parametrize(
    "n,k", [(96, 64), (101, 576), (7, 37), (960, 576), (576, 1536), (49, 3), (277, 64)]
)  # 277: AVX2 groups of 3 (1 row) or 2 (2-3 rows) panels, the last with the tail
def test_matches_torch(m, n, k):
    x, w, b = _data(m, n, k)
    torch.testing.assert_close(cpu_decode.linear(x, w, b), cpu_decode.linear_reference(x, w, b), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(cpu_decode.linear(x, w), x @ w.t(), atol=1e-4, rtol=1e-5)


@native
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_each_row_is_bitwise_the_same_whatever_else_is_in_the_batch(threads, fresh_state):
    cpu_decode.set_threads(threads)
    x, w, b = _data(70, 203, 577)  # panel tail (203 % 48), k tail (577 % 4), tiles of 8 rows with a tail
    full = cpu_decode.linear(x, w, b)  # [70, 203]
    for m in (1, 2, 3, 4, 5, 6, 8, 9, 16, 17, 40, 64):  # AVX2: 1-6 rows in tiles of 1-3 over 3 or 2 panels
        part = cpu_decode.linear(x[:m], w, b)
        assert torch.equal(part, full[:m]), f"rows differ when the batch has {m} rows"
    for r in (7, 8, 15, 63, 69):  # each position of a tile, alone
        assert torch.equal(cpu_decode.linear(x[r : r + 1], w, b)[0], full[r]), f"row {r} alone"
    assert torch.equal(cpu_decode.linear(x[3:43], w, b), full[3:43]), "a window that starts inside a tile"
    cpu_decode.set_threads(1)
    assert torch.equal(cpu_decode.linear(x, w, b), full), "the thread count changes no value"


@native
def test_results_are_exact_while_another_process_takes_the_cores(fresh_state):
    """Two kernel threads on a machine whose cores busy processes also want (the Serve ingress and proxy beside the
    engine): helpers get descheduled mid-chunk, and every call still waits for every chunk (a chunk not waited for
    shows as a wrong row, a helper that misses a generation as a hang)."""
    import subprocess
    import sys

    cpu_decode.set_threads(2)
    x, w, b = _data(8, 4096, 576)  # 86 panels: chunks long enough that the caller's wait outlasts its spin
    want = cpu_decode.linear(x, w, b)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for i in range(100):
            assert torch.equal(cpu_decode.linear(x, w, b), want), f"call {i} differs under contention"
    finally:
        for h in hogs:
            h.kill()
            h.wait()


@native
def test_blas_gemms_sends_prefill_rows_to_a_gemm_library_and_ends_with_its_block(monkeypatch, fresh_state):
    """Inside ``blas_gemms`` (a prefill) dispatch takes the GEMM library (oneDNN's packed linear where PyTorch has it)
    above ``PREFILL_NATIVE_ROWS`` rows and the native kernel up to it (the LM head on each prompt's last row);
    outside, the native kernel up to ``MAX_ROWS``."""
    native_rows, gemm_rows = [], []
    real_native, real_gemm = cpu_decode.linear, cpu_gemm.linear
    monkeypatch.setattr(cpu_decode, "linear", lambda *a: native_rows.append(a[0].shape[0]) or real_native(*a))
    monkeypatch.setattr(cpu_gemm, "linear", lambda *a: gemm_rows.append(a[0].shape[0]) or real_gemm(*a))
    small, w, b = _data(cpu_decode.PREFILL_NATIVE_ROWS, 96, 64)
    big, _, _ = _data(cpu_decode.PREFILL_NATIVE_ROWS + 1, 96, 64)
    with cpu_decode.blas_gemms():
        inside = cpu_decode.dispatch(big, w, b)
        cpu_decode.dispatch(small, w, b)
    library = [cpu_decode.PREFILL_NATIVE_ROWS + 1] if cpu_gemm.available() else []
    assert gemm_rows == library and native_rows == [cpu_decode.PREFILL_NATIVE_ROWS]
    torch.testing.assert_close(inside, torch.nn.functional.linear(big, w, b), atol=1e-4, rtol=1e-5)
    cpu_decode.dispatch(big, w, b)
    assert native_rows[-1] == cpu_decode.PREFILL_NATIVE_ROWS + 1 and len(gemm_rows) == len(library), (
        "after the block the native kernel is back"
    )


@native
def test_each_output_is_one_fma_chain_over_k_in_order():
    """The kernel's order written out in PyTorch: y[m, n] = fma(x[m, K-1], w[n, K-1], ... fma(x[m, 0], w[n, 0], 0)),
    one rounding per step, then + b[n]. (The float64 product is exact; float64 sum then fp32 rounding equals the
    FMA's single rounding except at double-rounding ties, which this seeded data does not hit.)"""
    x, w, b = _data(9, 50, 37)
    acc = torch.zeros(9, 50, dtype=torch.float32)
    for k in range(37):
        acc = (acc.double() + x[:, k : k + 1].double() * w[:, k].double()).float()  # [9, 50]
    assert torch.equal(cpu_decode.linear(x, w, b), acc + b)


@native
def test_packed_layout_is_panels_of_columns_kept_on_the_tensor():
    x, w, b = _data(3, 97, 64)
    p = cpu_panels.packed(w)
    cols = cpu_decode._load().linear_panel_cols()
    assert p.shape == (-(-97 // cols), 64, cols)
    assert torch.equal(p[1, :, 5], w[cols + 5]) and not p[-1, :, 97 % cols :].any(), "panels of columns, zeros past N"
    assert cpu_panels.packed(w) is p, "kept on the tensor (weight_cache: when it is made again)"
    with torch.no_grad():
        w.mul_(2)
    torch.testing.assert_close(cpu_decode.linear(x, w, b), x @ w.t() + b, atol=1e-4, rtol=1e-5)
    cpu_panels.forget_packed(w)
    assert not hasattr(w, cpu_panels._PACKED)


@native
def test_a_weight_of_bf16_values_is_packed_in_bf16_and_gives_the_fp32_panels_result_bit_for_bit(monkeypatch):
    """A draft saved in bf16 and loaded as fp32: its panels are stored in bf16 (half the bytes a decode step streams)
    and widened exactly as they are read, so the product is the fp32 panels' bit for bit; other weights stay fp32."""
    x, w, b = _data(9, 100, 70)  # two row tiles (8 + 1), a partial panel, a k tail
    w = w.to(torch.bfloat16).float()
    p = cpu_panels.packed(w)
    assert p.dtype == torch.bfloat16 and torch.equal(p.float(), cpu_panels.pack(w)), "the same values in half the bytes"
    y = cpu_decode.linear(x, w, b)
    cpu_panels.forget_packed(w)
    monkeypatch.setattr(cpu_panels, "bf16_values", lambda w: None)  # the same weight in fp32 panels
    assert cpu_panels.packed(w).dtype == torch.float32
    assert torch.equal(cpu_decode.linear(x, w, b), y)
    monkeypatch.undo()
    _, other, _ = _data(9, 100, 70, seed=1)
    assert cpu_panels.packed(other).dtype == torch.float32, "a weight that is not all bf16 values keeps fp32 panels"
    torch.testing.assert_close(cpu_decode.linear(x, other, b), x @ other.t() + b, atol=1e-4, rtol=1e-5)


@native
def test_strided_rows_are_read_in_place():
    x, w, _ = _data(4, 64, 128)
    wide = torch.randn(4, 300)
    wide[:, 10:138] = x
    view = wide[:, 10:138]  # row stride 300, unit column stride
    assert torch.equal(cpu_decode.linear(view, w), cpu_decode.linear(x, w))


@pytest.mark.parametrize(
    "bad,arg",
    [
        (lambda x, w, b: (x.double(), w, b), "x"),
        (lambda x, w, b: (x, w.t().contiguous().t(), b), "x/w"),
        (lambda x, w, b: (x[:, :-1], w, b), "x"),
        (lambda x, w, b: (x, w, b[:-1]), "b"),
        (lambda x, w, b: (x.t(), w[:, :8], b), "x/w"),
    ],
)
def test_checked_wrapper_names_the_argument(bad, arg):
    x, w, b = _data(8, 16, 8)
    with pytest.raises(KernelInputError, match=rf"^{arg}: expected .*Fix: "):
        cpu_decode.linear(*bad(x, w, b))


@native
def test_dispatch_keeps_autograd_and_large_batches_on_torch(fresh_state):
    cpu_decode.configure("native")
    x, w, b = _data(4, 32, 64)
    w.requires_grad_(True)
    y = cpu_decode.dispatch(x, w, b)
    y.sum().backward()  # the native kernel has no backward: dispatch must not have used it
    assert w.grad is not None
    big = torch.randn(cpu_decode.MAX_ROWS + 1, 64)
    assert torch.equal(cpu_decode.dispatch(big, w.detach(), b), torch.nn.functional.linear(big, w.detach(), b))
    small = x[:2]
    assert torch.equal(cpu_decode.dispatch(small, w.detach(), b), cpu_decode.linear(small, w.detach(), b))


def test_configure_torch_and_bad_modes(fresh_state):
    assert cpu_decode.configure("torch") == "torch (configured)"
    x, w, b = _data(2, 8, 16)
    assert torch.equal(cpu_decode.dispatch(x, w, b), torch.nn.functional.linear(x, w, b))
    with pytest.raises(KernelInputError, match="mode"):
        cpu_decode.configure("fast")
    with pytest.raises(KernelInputError, match="threads"):
        cpu_decode.set_threads(0)


@native
def test_a_compiler_that_fails_is_an_error_under_native_and_a_logged_fallback_under_auto(
    fresh_state, monkeypatch, tmp_path, caplog
):
    monkeypatch.setenv("EAGLERAY_HOME", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(cpu_decode, "_lib", None)
    with pytest.raises(KernelBuildError, match="building cpu_decode.c, cpu_layer.c, cpu_prefill.c failed"):
        cpu_decode.configure("native")
    with caplog.at_level("WARNING", logger="eagleray.kernels.cpu_decode"):
        status = cpu_decode.configure("auto")
    assert status.startswith("torch (building cpu_decode.c, cpu_layer.c, cpu_prefill.c failed")
    assert any("using torch.nn.functional.linear" in r.getMessage() for r in caplog.records)
    assert not list(tmp_path.rglob("*.so")), "a failed build leaves no library behind"


@native
def test_builds_once_into_eagleray_home(fresh_state, monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLERAY_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_decode, "_lib", None)
    assert cpu_decode.configure("native") == "native"
    built = list((tmp_path / "kernels").glob("cpu_decode-*.so"))
    assert len(built) == 1 and built[0] == cpu_decode_build.library_path()


def _cache(num_blocks=12, bs=4, hkv=3, d=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_blocks, bs, hkv, d, generator=g), torch.randn(num_blocks, bs, hkv, d, generator=g))


def _rows(spec):
    """spec: per row (seq, ctx, nnew, visible new indices) -> RowKeys."""
    mask = [sum(1 << i for i in vis) for _, _, _, vis in spec]
    as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return cpu_decode.RowKeys(
        as_t([r[0] for r in spec]),
        as_t([r[1] for r in spec]),
        as_t([r[2] for r in spec]),
        as_t([m - (1 << 64) if m >= 1 << 63 else m for m in mask]),
    )


TABLES = torch.tensor([[7, 2, 9, 0, 5], [5, 11, 3, -1, -1]], dtype=torch.int32)  # non-contiguous blocks


@native
def test_paged_attention_matches_the_reference_causal_and_tree():
    k, v = _cache()
    spec = [
        (0, 13, 1, [0]),  # a decode row of sequence 0
        (1, 5, 3, [0]),
        (1, 5, 3, [0, 1]),
        (1, 5, 3, [0, 1, 2]),  # a verify chain of sequence 1
        (0, 10, 4, [0, 2]),
        (0, 10, 4, [0, 1, 3]),
    ]  # tree rows: ancestors only
    rows = _rows(spec)
    q = torch.randn(len(spec), 9, 64, generator=torch.Generator().manual_seed(2))  # GQA 9/3
    out = cpu_decode.paged_attention(q, k, v, TABLES, rows, 0.125)
    torch.testing.assert_close(out, cpu_decode.paged_attention_reference(q, k, v, TABLES, rows, 0.125), atol=2e-5, rtol=1e-5)


@native
def test_a_rows_attention_is_bitwise_the_same_alone_in_a_batch_or_verified_beside_others():
    k, v = _cache()
    q = torch.randn(4, 9, 64, generator=torch.Generator().manual_seed(3))
    # the token at position 7 of sequence 0: decoded alone (ctx 7, 1 new) or row 2 of a verify chain (ctx 5, 4 new)
    alone = cpu_decode.paged_attention(q[2:3].contiguous(), k, v, TABLES, _rows([(0, 7, 1, [0])]), 0.125)
    chain = cpu_decode.paged_attention(q, k, v, TABLES, _rows([(0, 5, 4, list(range(i + 1))) for i in range(4)]), 0.125)
    assert torch.equal(alone[0], chain[2])
    causal = cpu_decode.paged_attention(q[2:3].contiguous(), k, v, TABLES, _rows([(0, 8, 0, [])]), 0.125)
    assert torch.equal(causal[0], alone[0]), "a causal row as 8 cached keys: the same keys in the same order"
    mixed = cpu_decode.paged_attention(
        q, k, v, TABLES, _rows([(1, 9, 1, [0]), (1, 3, 1, [0]), (0, 7, 1, [0]), (1, 6, 1, [0])]), 0.125
    )
    assert torch.equal(mixed[2], alone[0])


def test_paged_attention_refuses_bad_rows():
    k, v = _cache()
    q = torch.randn(2, 9, 64)
    with pytest.raises(KernelInputError, match=r"^rows.ctx: expected \[2\] int64"):
        cpu_decode.paged_attention(
            q,
            k,
            v,
            TABLES,
            cpu_decode.RowKeys(
                *(torch.zeros(2, dtype=torch.int64),) * 1,
                torch.zeros(2, dtype=torch.int32),
                torch.ones(2, dtype=torch.int64),
                torch.ones(2, dtype=torch.int64),
            ),
            0.1,
        )
    with pytest.raises(KernelInputError, match="block_tables"):
        cpu_decode.paged_attention(q, k, v, TABLES.long(), _rows([(0, 1, 1, [0])] * 2), 0.1)


@native
@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_equals_torch_with_ties_nans_infinities_and_tails(threads, fresh_state):
    cpu_decode.set_threads(threads)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 1000, generator=g)  # 1000 % 16: a masked tail
    x[1, [5, 700, 999]] = 50.0  # ties: the first index
    x[2, 998:] = 60.0  # the maximum in the tail
    x[3] = float("-inf")  # every value -inf: index 0
    x[4, [3, 640]] = float("nan")  # a NaN wins, the first one
    x[5, 17] = float("inf")
    x[6] = 0.0
    x[6, 300] = -0.0  # equal values: the first index
    x[7, 999] = float("nan")  # a NaN in the tail
    assert torch.equal(cpu_decode.argmax(x), cpu_decode.argmax_reference(x))
    wide = torch.randn(3, 1100, generator=g)
    assert torch.equal(cpu_decode.argmax(wide[:, 50:1050]), wide[:, 50:1050].argmax(-1)), "strided rows"
    assert torch.equal(cpu_decode.argmax_last(x.view(3, 3, 1000)), x.view(3, 3, 1000).argmax(-1))
    assert torch.equal(cpu_decode.argmax(torch.randn(2, 5, generator=g)[:, :1]), torch.zeros(2, dtype=torch.int64))


def test_argmax_refuses_what_it_does_not_handle():
    with pytest.raises(KernelInputError, match="^x: expected"):
        cpu_decode.argmax(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(KernelInputError, match="^x: expected"):
        cpu_decode.argmax(torch.zeros(3, 2).t())
