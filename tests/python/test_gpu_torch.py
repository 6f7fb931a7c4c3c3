"""The Python binding on a GPU with PyTorch tensors (skipped without torch or a CUDA device).

Binds torch tensors as weights and caches, runs the final norm through the binding eagerly and
inside torch.cuda.graph, and compares with torch's own arithmetic (HF transformers' RMSNorm: the
normalised value rounded to bf16 before the weight multiply). The bundle is DECODEPACK_TEST_BUNDLE
when set (a prebuilt .dpk), otherwise built with DECODEPACK_CLI.
"""

import json
import os
import shutil
import subprocess
import tempfile
import unittest

import decodepack as dp

try:
    import torch
    HAVE_CUDA = torch.cuda.is_available()
except ImportError:
    torch = None
    HAVE_CUDA = False


@unittest.skipUnless(HAVE_CUDA, "needs PyTorch with a CUDA device")
class TorchGpuTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="dp-python-gpu-")
        cls.path = os.environ.get("DECODEPACK_TEST_BUNDLE")
        if not cls.path:
            cli = os.environ["DECODEPACK_CLI"]
            model = os.path.join(cls.tmp, "model")
            subprocess.run([cli, "synth", "--preset", "kimi-linear-tiny", "-o", model], check=True)
            deploy = os.path.join(cls.tmp, "deploy.json")
            with open(deploy, "w") as f:
                json.dump({"targets": ["sm_90a"], "widths": [1, 2, 4, 8],
                           "prefetch": {"points": ["next_attention"]}}, f)
            cls.path = os.path.join(cls.tmp, "tiny.dpk")
            subprocess.run([cli, "build", "--model", model, "--deploy", deploy, "--no-weights", "-o", cls.path],
                           check=True)
        cls.bundle = dp.Bundle(cls.path)
        cls.session = dp.Session(cls.bundle, device=torch.cuda.current_device())
        cls.tensors = {}
        g = torch.Generator(device="cuda").manual_seed(0)
        for w in cls.bundle.weights(0):
            dtype = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}[w.dtype_name]
            if w.experts:
                t = torch.empty((w.experts, *w.shape), dtype=dtype, device="cuda")  # stacked, as FusedMoE
                cls.session.bind_expert_weights(w.name, t)
            else:
                t = torch.empty(w.shape, dtype=dtype, device="cuda")
                if w.name == "model.norm.weight":
                    t.copy_(torch.rand(w.shape, generator=g, device="cuda") + 0.5)
                cls.session.bind_weight(w.name, t)
            cls.tensors[w.name] = t
        cls.session.finalize_weights()
        cls.session.load_kernels()
        info = cls.bundle.info
        for layer in range(info["num_layers"]):
            kinds = ([dp.KV_KDA_STATE, dp.KV_CONV_Q, dp.KV_CONV_K, dp.KV_CONV_V]
                     if cls.bundle.layer(layer)["mixer"] == "kda" else [dp.KV_MLA_LATENT])
            for kind in kinds:
                lay = cls.session.kv_layout(layer, kind, 16)
                dtype = {dp.DTYPE_F32: torch.float32, dp.DTYPE_BF16: torch.bfloat16}[lay["dtype"]]
                t = torch.zeros(lay["shape"], dtype=dtype, device="cuda")
                cls.session.bind_kv(layer, kind, t)
                cls.tensors[(layer, kind)] = t
        cls.eps = info["rms_norm_eps"]
        cls.hidden = info["hidden_size"]

    @classmethod
    def tearDownClass(cls):
        cls.session.close()
        cls.bundle.close()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def reference(self, h, r):
        x = (h.float() + r.float()).to(torch.bfloat16)
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(torch.bfloat16)
        return (y.float() * self.tensors["model.norm.weight"].float()).to(torch.bfloat16), x

    def test_final_norm_eager_and_graph(self):
        for n in (1, 3, 8):
            with self.subTest(requests=n):
                plan = self.session.plan(n, [1] * n, num_accepted=[1] * n, state_indices=list(range(1, n + 1)),
                                         graph_mode=dp.GRAPH_FULL)
                self.assertEqual(plan.reason, dp.REASON_NONE, plan.message)
                h = torch.randn(plan.rows, self.hidden, device="cuda").to(torch.bfloat16)
                r = torch.randn(plan.rows, self.hidden, device="cuda").to(torch.bfloat16)
                want_out, want_res = self.reference(h, r)
                hh, rr = h.clone(), r.clone()
                stream = torch.cuda.current_stream()
                self.session.launch_final_norm(plan, hidden=hh, residual=rr, out=hh, residual_out=rr, stream=stream)
                torch.cuda.synchronize()
                self.assertTrue(torch.equal(rr, want_res))
                torch.testing.assert_close(hh.float(), want_out.float(), rtol=2 ** -6, atol=1e-3)

                # Captured by torch, replayed with new inputs copied into the captured buffers.
                hh2, rr2 = h.clone(), r.clone()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):  # torch's capture stream, global capture mode
                    s = torch.cuda.current_stream()
                    self.assertTrue(self.session.prefetch_fork(dp.PREFETCH_NEXT_ATTENTION, 1, plan.width, stream=s))
                    self.session.launch_final_norm(plan, hidden=hh2, residual=rr2, out=hh2, residual_out=rr2, stream=s)
                    self.session.prefetch_join(stream=s)
                h3 = torch.randn_like(h.float()).to(torch.bfloat16)
                r3 = torch.randn_like(r.float()).to(torch.bfloat16)
                hh2.copy_(h3)
                rr2.copy_(r3)
                graph.replay()
                torch.cuda.synchronize()
                want_out, want_res = self.reference(h3, r3)
                self.assertTrue(torch.equal(rr2, want_res))
                torch.testing.assert_close(hh2.float(), want_out.float(), rtol=2 ** -6, atol=1e-3)
        self.session.after_step()

    def test_error_flag_from_torch(self):
        addr, value = self.session.error_flag()
        self.assertNotEqual(addr, 0)
        self.assertEqual(value, 0)


if __name__ == "__main__":
    unittest.main()
