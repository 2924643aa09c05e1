"""Faults injected into the statistics round by tests (test_callback.py, fsdp_worker.py)."""

from collections.abc import Callable

from lightning_snip.formats import Format


def nan_forward_weights(fmt: Format, weight_shape: tuple[int, int],
                        when: Callable[[], bool] = lambda: True) -> dict[str, Callable]:
    """Replacements for lightning_snip.loss_divergence's ``quantize_stack`` and ``_output_errors`` (name -> function,
    for monkeypatch.setattr or assignment) whose forward output errors are NaN for layers with weights of
    ``weight_shape`` (out, in) in ``fmt`` while ``when()`` holds: a quantizer fault, as an all-zero block once
    gave on a GPU. The forward quantizes the weights stacked by shape; the gradient GEMMs' operands are left
    alone."""
    import lightning_snip.loss_divergence as div

    real, real_forward, in_forward = div.quantize_stack, div._output_errors, []

    def output_errors(*args, **kw):  # the forward GEMM's errors of one group of layers
        in_forward.append(True)
        try:
            return real_forward(*args, **kw)
        finally:
            in_forward.pop()

    def quantize_stack(t, f, **kw):
        out = real(t, f, **kw)
        weight = in_forward and not kw.get("is_grad") and tuple(t.shape[-2:]) == tuple(weight_shape)
        return out * float("nan") if weight and f is fmt and when() else out

    return {"quantize_stack": quantize_stack, "_output_errors": output_errors}


def broken_fp4_forward(*args, **kwargs) -> Callable:
    """A layer whose FP4 forward is broken on purpose (the spike guard's tests): written beside the benchmark
    that measures the guard with it (benchmarks/harness.py), imported from there when used."""
    from harness import broken_fp4_forward as broken

    return broken(*args, **kwargs)


def training_path_fault(kind: str) -> Callable:
    """A training-path-only GEMM fault (the guard's tests and benchmarks/guard_faults.py): written beside the
    benchmark that measures the guard with it (benchmarks/harness.py), imported from there when used."""
    from harness import training_path_fault as fault

    return fault(kind)
