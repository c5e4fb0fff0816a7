"""Why does mok.moe's backward with a shared expert fail on a GPU ("mok.grouped_gemm_bf16_dgrad_swiglu: kernel launch
failed: invalid argument", tests/test_layer.py::test_the_custom_op_backward_with_a_shared_expert_runs) where
fused.backward on the same inputs runs? An open experiment (docs/lab/roadmap.md, item 0): delete it once answered,
its answer in docs/fused.md.

Every binding of the extension is wrapped to log its arguments (shapes, strides, dtype, device, address mod 256,
storage offset, contiguity) with the calling thread and current device; the fused level's backward runs directly,
then through the custom op (autograd's device thread), and the two call lists are printed side by side, the first
failing call's arguments with them.
    python3 tools/custom_op_probe.py"""
import threading
import traceback

import torch

import mok
from mok import fused
from mok.config import MoEConfig
from mok.ops.core import load_extension
from mok.testing import make_inputs, moe_args

ext = load_extension()
LOG = []


def desc(v):
    if isinstance(v, torch.Tensor):
        return (f"T{tuple(v.shape)} s{tuple(v.stride())} {v.dtype} {v.device} ptr%256={v.data_ptr() % 256} "
                f"off={v.storage_offset()} c={v.is_contiguous()}")
    return repr(v)


def wrap(name, f):
    def g(*a, **k):
        line = (name, threading.current_thread().name, torch.cuda.current_device(),
                [desc(v) for v in a], {kk: desc(v) for kk, v in k.items()})
        LOG.append(line)
        try:
            return f(*a, **k)
        except Exception as e:
            print("FAILED", line, e, flush=True)
            torch.cuda.synchronize()
            raise
    return g


for n in dir(ext):
    if not n.startswith("_") and callable(getattr(ext, n)):
        setattr(ext, n, wrap(n, getattr(ext, n)))

inp = make_inputs(MoEConfig("op-shared", 256, 256, 128, 8, 2, shared_intermediate=128), "cuda")
with torch.no_grad():
    _, saved = fused.forward(*moe_args(inp))
    LOG.clear()
    want = fused.backward(saved, inp["d_out"])
direct = list(LOG)
LOG.clear()
args = [a.requires_grad_() if a is not None and a.is_floating_point() and i != 2 else a
        for i, a in enumerate(moe_args(inp))]
out = mok.moe(*args, backend="fused")
LOG.clear()
try:
    out.backward(inp["d_out"])
    print("custom op backward ran")
except Exception:
    traceback.print_exc()
custom = list(LOG)
print("direct calls:", len(direct), "custom calls:", len(custom))
for i in range(max(len(direct), len(custom))):
    a = direct[i] if i < len(direct) else None
    b = custom[i] if i < len(custom) else None
    same = a is not None and b is not None and a[0] == b[0] and a[2:] == b[2:]
    print(f"--- call {i} {'same' if same else 'DIFF'}")
    if not same:
        print("  direct:", a)
        print("  custom:", b)
    else:
        print("  ", a[0], a[1], "|", b[1])
