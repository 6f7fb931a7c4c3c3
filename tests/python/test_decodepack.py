"""Tests of the Python binding (runtime/python/decodepack) on a real bundle built by the decodepack CLI.

Environment (set by ctest): DECODEPACK_LIBRARY (libdecodepack.so), DECODEPACK_CLI (the decodepack
tool), PYTHONPATH (runtime/python), DECODEPACK_TEST_CACHE (compile cache kept between runs);
DECODEPACK_PY_TEST_BUNDLE instead of the CLI: the bundle setUpClass would build, built elsewhere.
Runs on a host without a GPU: sessions are host-only, except the test that expects the driver to be
missing.
"""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import unittest

import decodepack as dp

QPROJ = "model.layers.1.self_attn.q_proj.weight"
W1 = "model.layers.1.block_sparse_moe.experts.{e}.w1.weight"


def _cli(*args):
    cli = os.environ["DECODEPACK_CLI"]
    r = subprocess.run([cli, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise RuntimeError("decodepack %s failed (%d):\n%s" % (args[0], r.returncode, r.stdout))
    return r.stdout


def _bind_all(session, bundle, rank=0, base=0x7F0000000000):
    addr = base
    for w in bundle.weights(rank):
        n = 1
        for s in w.shape:
            n *= s
        size = (n * 4 + 255) // 256 * 256
        if w.experts:
            ptrs = [addr + e * size for e in range(w.experts)]
            addr += w.experts * size
            session.bind_expert_weights(w.name, ptrs, dtype=w.dtype, shape=w.shape)
        else:
            session.bind_weight(w.name, addr, dtype=w.dtype, shape=w.shape)
            addr += size


def _bind_kv(session, bundle, slots=32, blocks=16, base=0x7E0000000000):
    addr = base
    for l in range(bundle.info["num_layers"]):
        kinds = ([dp.KV_KDA_STATE, dp.KV_CONV_Q, dp.KV_CONV_K, dp.KV_CONV_V] if bundle.layer(l)["mixer"] == "kda"
                 else [dp.KV_MLA_LATENT])
        for kind in kinds:
            lay = session.kv_layout(l, kind, blocks if kind == dp.KV_MLA_LATENT else slots)
            session.bind_kv(l, kind, addr, dtype=lay["dtype"], shape=lay["shape"], strides=lay["strides"])
            addr += 1 << 32


class _FakeGroup:
    """A process group of len(values) ranks in one process: rank `rank` calls, the others' values are given."""

    def __init__(self, rank, values):
        self.rank, self.values, self.calls, self.seen = rank, list(values), 0, None


class _fake_torch_distributed:
    """Installs a stand-in `torch.distributed` (get_world_size, all_gather_object) for the with-block and
    yields its group; the binding imports torch lazily, so it picks the stand-in up."""

    def __init__(self, rank, values):
        self.group = _FakeGroup(rank, values)

    def __enter__(self):
        import types

        group = self.group
        dist = types.ModuleType("torch.distributed")

        def get_world_size(group=None):
            return len(group.values)

        def all_gather_object(out, obj, group=None):
            assert len(out) == len(group.values)
            group.calls += 1
            gathered = list(group.values)
            gathered[group.rank] = obj
            group.seen = gathered
            out[:] = gathered

        dist.get_world_size, dist.all_gather_object = get_world_size, all_gather_object
        torch = types.ModuleType("torch")
        torch.distributed = dist
        self.saved = {k: sys.modules.get(k) for k in ("torch", "torch.distributed")}
        sys.modules["torch"], sys.modules["torch.distributed"] = torch, dist
        return group

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        return False


class BindingTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="dp-python-")
        # A copy built elsewhere with the same synth/build commands (a machine without the CLI).
        cls.path = os.environ.get("DECODEPACK_PY_TEST_BUNDLE")
        if cls.path:
            return
        cache = os.environ.get("DECODEPACK_TEST_CACHE") or os.path.join(cls.tmp, "cache")
        model = os.path.join(cls.tmp, "model")
        _cli("synth", "--preset", "kimi-linear-tiny", "--seed", "0", "-o", model)
        deploy = os.path.join(cls.tmp, "deploy.json")
        with open(deploy, "w") as f:
            json.dump({"targets": ["sm_90a"], "widths": [1, 2, 4]}, f)
        cls.path = os.path.join(cls.tmp, "tiny.dpk")
        _cli("build", "--model", model, "--deploy", deploy, "--no-weights", "-o", cls.path, "--cache-dir", cache,
             "-j", "2")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        self.bundle = dp.Bundle(self.path)

    def tearDown(self):
        self.bundle.close()

    def session(self, **kw):
        kw.setdefault("device", None)
        return dp.Session(self.bundle, **kw)

    def ready_session(self):
        s = self.session()
        _bind_all(s, self.bundle)
        s.finalize_weights()
        _bind_kv(s, self.bundle)
        return s

    # ---- bundle -----------------------------------------------------------------------------------

    def test_version(self):
        major, minor, patch = (int(x) for x in dp.version().split("."))
        self.assertGreaterEqual(major * 10000 + minor * 100 + patch, 100)
        self.assertEqual(dp.__version__, dp.version())  # the binding and the library it loaded

    def test_info(self):
        info = self.bundle.info
        self.assertEqual(info["format_version"], (1, 5))
        self.assertTrue(info["digest"].startswith("sha256:"))
        self.assertEqual(info["widths"], [1, 2, 4])
        self.assertEqual(info["targets"], ["sm_90a"])
        self.assertEqual(info["q"], 1)
        self.assertEqual(info["num_layers"], 4)
        self.assertFalse(info["weights_fingerprinted"])
        self.assertEqual(info["indexer"], {"heads": 0, "top_k": 0, "prefill_workspace_bytes": 0})  # no indexer
        self.assertRegex(info["config_digest"], r"^sha256:[0-9a-f]{64}$")
        self.assertEqual(info["deploy"]["targets"], ["sm_90a"])
        manifest = self.bundle.manifest
        self.assertEqual(manifest["deploy"], info["deploy"])
        self.assertEqual(manifest["model"]["config_digest"], info["config_digest"])
        self.assertEqual(info["vocab_size"], manifest["model"]["vocab_size"])
        self.assertEqual(self.bundle.layer(3), {"index": 3, "mixer": "mla", "ffn": "moe", "class": "mla_moe"})
        weights = {w.name: w for w in self.bundle.weights(0)}
        self.assertEqual(len(weights), 86)
        self.assertEqual(weights[W1].experts, 16)
        self.assertEqual(weights[W1].shape, (128, 256))
        self.assertEqual(weights[W1].dtype_name, "BF16")
        self.assertEqual(weights["model.norm.weight"].layer, -1)

    def test_weight_counts_agree_with_the_cli(self):
        # One bundle, three counts with three names: entries to bind (an expert group is one), the decode
        # tensors they hold, and the checkpoint's tensors (with the embeddings and LM head the host keeps).
        counts = self.bundle.weight_counts(0)
        self.assertEqual(counts["weight_entries"], 86)
        self.assertEqual(counts["weight_entries"], len(self.bundle.weights(0)))
        inspect = json.loads(_cli("inspect", self.path, "--json"))
        self.assertEqual(inspect["ranks"][0]["weight_entries"], counts["weight_entries"])
        self.assertEqual(inspect["ranks"][0]["decode_tensors"], counts["decode_tensors"])
        self.assertEqual(inspect["ranks"][0]["decode_bytes"], counts["decode_bytes"])
        deploy = os.path.join(self.tmp, "deploy.json")
        if os.path.exists(deploy):  # the bundle was built here
            plan = json.loads(_cli("plan", "--model", "kimi-linear-tiny", "--deploy", deploy, "--json"))
            for key in ("weight_entries", "decode_tensors", "decode_bytes"):
                self.assertEqual(plan["ranks"][0][key], counts[key], key)
            self.assertEqual(plan["model"]["checkpoint_tensors"], counts["decode_tensors"] + 2)  # embeddings, LM head

    def test_open_errors(self):
        with self.assertRaises(dp.DecodepackError) as e:
            dp.Bundle(os.path.join(self.tmp, "missing.dpk"))
        self.assertEqual(e.exception.code, dp.ERR_IO)
        self.assertEqual(e.exception.code_name, "DP_ERR_IO")
        self.assertIn("missing.dpk", e.exception.message)
        bad = os.path.join(self.tmp, "bad.dpk")
        with open(self.path, "rb") as f:
            data = bytearray(f.read())
        data[2000] ^= 0xFF  # inside the first code object
        with open(bad, "wb") as f:
            f.write(data)
        with self.assertRaises(dp.DecodepackError) as e:
            dp.Bundle(bad)
        self.assertEqual(e.exception.code, dp.ERR_INTEGRITY, e.exception.message)

    def test_hostile_manifest_is_refused(self):
        # A manifest nested 10^6 deep (issue 12) once overflowed the stack inside libdecodepack and killed
        # the host process; now it is refused with a status. Run in a child so that a crash is reported.
        d = os.path.join(self.tmp, "deep")
        shutil.rmtree(d, ignore_errors=True)
        with tarfile.open(self.path) as t:
            t.extractall(d)  # the bundle built in setUpClass
        with open(os.path.join(d, "manifest.json")) as f:
            m = json.load(f)
        m["toolchains"]["zz"] = "@@"
        text = json.dumps(m, sort_keys=True, separators=(",", ":")).replace('"@@"', "[" * 1000000 + "]" * 1000000)
        with open(os.path.join(d, "manifest.json"), "w") as f:
            f.write(text + "\n")
        archive = os.path.join(self.tmp, "deep.dpk")
        with tarfile.open(archive, "w", format=tarfile.USTAR_FORMAT) as t:
            for name in sorted(os.listdir(d)):
                t.add(os.path.join(d, name), arcname=name)
        child = ("import decodepack as dp, sys\n"
                 "try:\n    dp.Bundle(sys.argv[1])\nexcept dp.DecodepackError as e:\n"
                 "    print(e.code_name, e.message)\n    sys.exit(0)\nsys.exit(3)\n")
        for path in (d, archive):
            r = subprocess.run([sys.executable, "-c", child, path], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, "%s: exit %d\n%s%s" % (path, r.returncode, r.stdout, r.stderr))
            self.assertIn("DP_ERR_FORMAT", r.stdout)
            self.assertIn("nested deeper than 64 levels", r.stdout)

    def test_validity(self):
        self.bundle.query_validity()
        self.bundle.query_validity(dp.device_desc("sm_90", driver_version=13000), rank=0)
        with self.assertRaises(dp.DecodepackError) as e:
            self.bundle.query_validity(dp.device_desc("sm_100", driver_version=13000))
        self.assertEqual(e.exception.code, dp.ERR_TARGET)
        self.assertIn("add sm_100a", e.exception.message)
        with self.assertRaises(dp.DecodepackError) as e:
            self.bundle.query_validity(dp.device_desc("sm_90", driver_version=12080))
        self.assertEqual(e.exception.code, dp.ERR_DRIVER_VERSION)
        with self.assertRaises(dp.DecodepackError) as e:
            self.bundle.query_validity(dp.device_desc("sm_90", max_threads_per_block=32))
        self.assertEqual(e.exception.code, dp.ERR_DEVICE_LIMITS)
        with self.assertRaises(dp.DecodepackError) as e:
            self.bundle.query_validity(rank=1)
        self.assertEqual(e.exception.code, dp.ERR_RANK)

    def test_no_driver(self):
        try:
            dp.query_device(0)
            self.skipTest("this host has a CUDA driver")
        except dp.DecodepackError as e:
            self.assertEqual(e.code, dp.ERR_DRIVER_UNAVAILABLE)
            self.assertIn("libcuda.so.1", e.message)
        self.assertEqual(dp.device_count(), 0)  # no driver: no devices, not an exception
        with self.assertRaises(dp.DecodepackError) as e:
            dp.Session(self.bundle, device=0)
        self.assertEqual(e.exception.code, dp.ERR_DRIVER_UNAVAILABLE)

    # ---- binding ----------------------------------------------------------------------------------

    def test_bind_everything(self):
        s = self.session()
        self.assertEqual(s.target, "sm_90a")
        _bind_all(s, self.bundle)
        s.finalize_weights()

    def test_binding_errors(self):
        s = self.session()
        cases = [
            (("model.embed_tokens.weight", 0x1000, "BF16", (16, 256)), dp.ERR_UNKNOWN_TENSOR, "not a weight of rank 0"),
            ((QPROJ, 0x1000, "F32", (256, 256)), dp.ERR_DTYPE, "dtype F32, expected BF16"),
            ((QPROJ, 0x1000, "BF16", (256, 128)), dp.ERR_SHAPE, "shape [256, 128], expected [256, 256]"),
            ((QPROJ, 0x1008, "BF16", (256, 256)), dp.ERR_ALIGNMENT, "not a multiple of 16 bytes"),
            ((QPROJ, 0, "BF16", (256, 256)), dp.ERR_INVALID_ARGUMENT, "data address is 0"),
            ((W1, 0x1000, "BF16", (128, 256)), dp.ERR_INVALID_ARGUMENT, "is an expert group"),
        ]
        for (name, addr, dtype, shape), code, fragment in cases:
            with self.subTest(name=name, code=code):
                with self.assertRaises(dp.DecodepackError) as e:
                    s.bind_weight(name, addr, dtype=dtype, shape=shape)
                self.assertEqual(e.exception.code, code, e.exception.message)
                self.assertIn(fragment, e.exception.message)
        with self.assertRaises(dp.DecodepackError) as e:
            s.bind_weight(QPROJ, 0x1000, dtype="BF16", shape=(256, 256), strides=(512, 1))
        self.assertEqual(e.exception.code, dp.ERR_LAYOUT)

    def test_rebinding_rules(self):
        s = self.session()
        s.bind_weight(QPROJ, 0x10000, dtype="BF16", shape=(256, 256))
        s.bind_weight(QPROJ, 0x10000, dtype="BF16", shape=(256, 256))  # same address: accepted
        with self.assertRaises(dp.DecodepackError) as e:
            s.bind_weight(QPROJ, 0x20000, dtype="BF16", shape=(256, 256))
        self.assertEqual(e.exception.code, dp.ERR_REBIND)
        self.assertIn("weight reloads are not supported", e.exception.message)

    def test_expert_groups(self):
        s = self.session()
        ptrs = [0x100000 + e * 0x10000 for e in range(16)]
        s.bind_expert_weights(W1, ptrs, dtype="BF16", shape=(128, 256))
        s.bind_weight(W1.replace("{e}", "3"), ptrs[3], dtype="BF16", shape=(128, 256))
        with self.assertRaises(dp.DecodepackError) as e:
            s.bind_expert_weights(W1, ptrs[:4], dtype="BF16", shape=(128, 256))
        self.assertEqual(e.exception.code, dp.ERR_SHAPE)
        self.assertIn("4 experts given, the rank holds 16", e.exception.message)

    def test_finalize_names_missing(self):
        s = self.session()
        s.bind_weight(QPROJ, 0x10000, dtype="BF16", shape=(256, 256))
        with self.assertRaises(dp.DecodepackError) as e:
            s.finalize_weights()
        self.assertEqual(e.exception.code, dp.ERR_MISSING_TENSOR)
        self.assertIn("85 of 86 weights are not bound", e.exception.message)

    def test_kv(self):
        s = self.session()
        lay = s.kv_layout(0, dp.KV_KDA_STATE, 8)
        self.assertEqual(lay["shape"], (8, 2, 128, 128))
        self.assertEqual(lay["dtype"], dp.DTYPE_F32)
        self.assertEqual(s.kv_layout(3, dp.KV_MLA_LATENT, 4)["shape"], (4, 64, 576))
        s.bind_kv(3, dp.KV_MLA_LATENT, 0x10000, dtype="BF16", shape=(4, 64, 576))
        s.bind_kv(3, dp.KV_MLA_LATENT, 0x10000, dtype="BF16", shape=(400, 64, 576))  # grew in place
        with self.assertRaises(dp.DecodepackError) as e:
            s.bind_kv(3, dp.KV_MLA_LATENT, 0x20000, dtype="BF16", shape=(400, 64, 576))
        self.assertEqual(e.exception.code, dp.ERR_REBIND)
        s.release_kv()
        s.bind_kv(3, dp.KV_MLA_LATENT, 0x20000, dtype="BF16", shape=(400, 64, 576))
        with self.assertRaises(dp.DecodepackError) as e:
            s.bind_kv(3, dp.KV_KDA_STATE, 0x30000, dtype="F32", shape=(4, 2, 128, 128))
        self.assertEqual(e.exception.code, dp.ERR_UNKNOWN_TENSOR)

    # ---- planning ---------------------------------------------------------------------------------

    def test_plan_cases(self):
        s = self.session()
        _bind_all(s, self.bundle)
        s.finalize_weights()
        self.assertEqual(s.plan(1, [1]).reason, dp.REASON_NO_KV)
        _bind_kv(s, self.bundle)
        cases = [
            (dict(num_requests=1, query_lens=[1]), dp.REASON_NONE, 1),
            (dict(num_requests=3, query_lens=[1, 1, 1], state_indices=[1, 2, 3], num_accepted=[1, 1, 1]),
             dp.REASON_NONE, 4),
            (dict(num_requests=4, query_lens=[1] * 4, state_indices=[5, 6, 0, 0], num_accepted=[1] * 4,
                  graph_mode=dp.GRAPH_FULL), dp.REASON_NONE, 4),
            (dict(num_requests=5, query_lens=[1] * 5), dp.REASON_TOO_MANY_REQUESTS, 0),
            (dict(num_requests=2, query_lens=[1, 1], graph_mode=dp.GRAPH_PIECEWISE), dp.REASON_PIECEWISE, 0),
            (dict(num_requests=2, query_lens=[1, 1], pp_stage_input=True), dp.REASON_PP_STAGE_INPUT, 0),
            (dict(num_requests=2, query_lens=[1, 7]), dp.REASON_NOT_UNIFORM, 0),
            (dict(num_requests=2, query_lens=[1, 1], state_indices=[1, 99]), dp.REASON_BAD_METADATA, 0),
            # a 2-D block table as a list of rows (flattened row-major), or flat
            (dict(num_requests=2, query_lens=[1, 1], block_table=[[1, 2], [3, 0]], block_table_stride=2,
                  block_table_cols=2), dp.REASON_NONE, 2),
            (dict(num_requests=2, query_lens=[1, 1], block_table=[[1, 2], [99, 0]], block_table_stride=2,
                  block_table_cols=2), dp.REASON_BAD_METADATA, 0),
            (dict(num_requests=2, query_lens=[1, 1], block_table=[1, 2, 99, 0], block_table_stride=2,
                  block_table_cols=2), dp.REASON_BAD_METADATA, 0),
        ]
        for kw, reason, width in cases:
            with self.subTest(**{k: str(v) for k, v in kw.items()}):
                p = s.plan(**kw)
                self.assertEqual(p.reason, reason, p.message)
                self.assertEqual(p.width, width)
                if reason == dp.REASON_NONE:
                    self.assertTrue(p.step)
                    self.assertEqual(p.rows, width)
                    self.assertTrue(p.layer_kernel(0))  # the bundle has every class's program
                else:
                    self.assertFalse(p.step)
                    self.assertTrue(p.message)

    def test_agree(self):
        self.assertEqual(dp.agree([0, 0, 0, 0]), (dp.REASON_NONE, -1))
        self.assertEqual(dp.agree([0, dp.REASON_NOT_UNIFORM, dp.REASON_NO_KV, 0]), (dp.REASON_NOT_UNIFORM, 1))
        self.assertEqual(dp.agree([])[0], dp.REASON_INVALID)

    def test_after_step_and_error_flag(self):
        s = self.ready_session()
        self.assertEqual(s.error_flag(), (0, 0))
        s.after_step()
        s.raise_error_flag(dp.FLAG_WAIT_TIMEOUT | (3 << 16))
        with self.assertRaises(dp.DecodepackError) as e:
            s.after_step()
        self.assertEqual(e.exception.code, dp.ERR_ABORTED)
        self.assertIn("first in layer 2", e.exception.message)
        with self.assertRaises(dp.DecodepackError):
            s.plan(1, [1])

    def test_agree_over_a_group(self):
        # Rank 2 of 4 refuses: every rank, whatever its own reason, gets rank 2's reason and number.
        for rank in range(4):
            reasons = [dp.REASON_NONE, dp.REASON_NONE, dp.REASON_NOT_UNIFORM, dp.REASON_NO_KV]
            with _fake_torch_distributed(rank, reasons) as group:
                self.assertEqual(dp.agree(reasons[rank], group=group), (dp.REASON_NOT_UNIFORM, 2))
                self.assertEqual(group.calls, 1)  # one all-gather per step
        with _fake_torch_distributed(1, [0, 0]) as group:
            self.assertEqual(dp.agree(dp.REASON_NONE, group=group), (dp.REASON_NONE, -1))
        # A Plan stands for its reason.
        plan = self.ready_session().plan(2, [1, 1])
        with _fake_torch_distributed(0, [0, 0]) as group:
            self.assertEqual(dp.agree(plan, group=group), (dp.REASON_NONE, -1))
        with _fake_torch_distributed(0, [0, dp.REASON_PIECEWISE]) as group:
            self.assertEqual(dp.agree(plan, group=group), (dp.REASON_PIECEWISE, 1))

    def test_after_step_over_a_group_raises_on_every_rank(self):
        s = self.ready_session()
        # No rank failed: nothing raised, one all-gather.
        with _fake_torch_distributed(0, [None, None]) as group:
            s.after_step(group=group)
            self.assertEqual(group.calls, 1)
        # Rank 1 gave up a wait; this rank (0) did not, and raises rank 1's error all the same.
        with _fake_torch_distributed(0, [None, (dp.ERR_ABORTED, "error flag 0x00040209: ... layer 3")]) as group:
            with self.assertRaises(dp.DecodepackError) as e:
                s.after_step(group=group)
        self.assertEqual(e.exception.code, dp.ERR_ABORTED)
        self.assertIn("rank 1: error flag 0x00040209", e.exception.message)
        # This rank's own flag: its error goes to the group and comes back named by its rank.
        s.raise_error_flag(dp.FLAG_WAIT_TIMEOUT | (1 << 2) | (2 << 8) | (4 << 16))
        with _fake_torch_distributed(1, [None, None]) as group:
            with self.assertRaises(dp.DecodepackError) as e:
                s.after_step(group=group)
            self.assertEqual(group.seen[1][0], dp.ERR_ABORTED)
        self.assertIn("rank 1: ", e.exception.message)
        self.assertIn("gave up waiting for rank 1 (first in layer 3, after the o-projection)", e.exception.message)

    def test_binding_imports_without_torch(self):
        code = ("import sys; sys.modules['torch'] = None; import decodepack as dp; "
                "print(dp.agree([0, 5])); dp.agree(0, group=object())")
        r = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(r.stdout.strip(), "(5, 1)")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("needs torch.distributed", r.stderr)

    def test_exchange_buffers_of_a_tensor_parallel_bundle(self):
        self.assertEqual(self.ready_session().exchange_bytes(), 0)
        with self.assertRaises(dp.DecodepackError) as e:
            self.ready_session().set_peers([0x7F0000000000])
        self.assertEqual(e.exception.code, dp.ERR_INVALID_ARGUMENT)
        self.assertIn("do not all-reduce (tensor_parallel 1)", e.exception.message)

    def test_nccl_path_on_a_bundle_without_nccl_widths(self):
        s = self.ready_session()
        self.assertEqual(s.nccl_widths(), [])
        with self.assertRaises(dp.DecodepackError) as e:
            s.init_nccl(bytes(128))
        self.assertEqual(e.exception.code, dp.ERR_INVALID_ARGUMENT)
        self.assertIn("do not all-reduce with NCCL at any width", e.exception.message)
        with self.assertRaises(ValueError):
            s.init_nccl(bytes(16))

    def test_nccl_unique_id_names_a_missing_library(self):
        with self.assertRaises(dp.DecodepackError) as e:
            dp.nccl_unique_id("libnccl-not-here.so.2")
        self.assertEqual(e.exception.code, dp.ERR_NCCL_UNAVAILABLE)
        self.assertIn("libnccl-not-here.so.2 cannot be loaded", e.exception.message)
        self.assertEqual(dp.CODES[dp.ERR_NCCL_UNAVAILABLE], "DP_ERR_NCCL_UNAVAILABLE")
        self.assertEqual(dp.REASON_NO_COMMUNICATOR, 8)

    def test_unique_id_broadcast_over_a_group(self):
        # A stand-in torch: the group's first rank makes the id (here: no NCCL, so it raises), every other
        # rank receives the broadcast bytes.
        import types

        payload = bytes(range(128))

        class T:
            def __init__(self, v):
                self.v = list(v)

            def copy_(self, o):
                self.v = list(o.v)
                return self

            def cpu(self):
                return self

            def tolist(self):
                return list(self.v)

        def fake(rank):
            torch = types.ModuleType("torch")
            dist = types.ModuleType("torch.distributed")
            torch.uint8 = "uint8"
            torch.zeros = lambda n, dtype=None, device=None: T([0] * n)
            torch.frombuffer = lambda b, dtype=None: T(b)
            dist.get_rank = lambda: rank
            dist.get_global_rank = lambda group, r: 0
            dist.broadcast = lambda t, src, group=None: t.v.__setitem__(slice(None), payload) if rank != src else None
            torch.distributed = dist
            return {"torch": torch, "torch.distributed": dist}

        saved = {k: sys.modules.get(k) for k in ("torch", "torch.distributed")}
        try:
            sys.modules.update(fake(1))
            self.assertEqual(dp.broadcast_nccl_unique_id(group=object()), payload)
            sys.modules.update(fake(0))
            with self.assertRaises(dp.DecodepackError) as e:
                dp.broadcast_nccl_unique_id(group=object(), library="libnccl-not-here.so.2")
            self.assertEqual(e.exception.code, dp.ERR_NCCL_UNAVAILABLE)
        finally:
            for k, v in saved.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v

    def test_launch_on_host_only_session(self):
        s = self.ready_session()
        p = s.plan(2, [1, 1])
        with self.assertRaises(dp.DecodepackError) as e:
            s.launch_layer(p, 0, hidden=0x1000, out=0x1000, residual_out=0x2000)
        self.assertEqual(e.exception.code, dp.ERR_NO_DEVICE)
        with self.assertRaises(dp.DecodepackError) as e:
            s.launch_final_norm(p, hidden=0x1000, out=0x1000, residual_out=0x2000)
        self.assertEqual(e.exception.code, dp.ERR_NO_DEVICE)
        with self.assertRaises(dp.DecodepackError) as e:
            s.prefetch_fork(dp.PREFETCH_NEXT_ATTENTION, 1, 2)
        self.assertEqual(e.exception.code, dp.ERR_NO_DEVICE)
        with self.assertRaises(dp.DecodepackError) as e:
            s.launch_lm_head(p, hidden=0x1000, logits=0x2000)
        self.assertEqual(e.exception.code, dp.ERR_NO_DEVICE)

    def test_lm_head_binding(self):
        s = self.session()
        s.bind_lm_head(0x10000, dtype="BF16", shape=(1024, 256))  # the tiny preset's vocabulary
        with self.assertRaises(dp.DecodepackError) as e:
            s.bind_lm_head(0x20000, dtype="BF16", shape=(1024, 256))
        self.assertEqual(e.exception.code, dp.ERR_REBIND)
        with self.assertRaises(dp.DecodepackError) as e:
            s.bind_lm_head(0x10000, dtype="BF16", shape=(1000, 256))
        self.assertIn("expected [1024, 256]", e.exception.message)

    def test_torch_tensors(self):
        try:
            import torch
        except ImportError:
            self.skipTest("PyTorch is not installed")
        s = self.session()
        q = torch.empty(256, 256, dtype=torch.bfloat16)
        s.bind_weight(QPROJ, q)  # a host-only session records the address without reading it
        with self.assertRaises(dp.DecodepackError) as e:
            s.bind_weight("model.layers.1.self_attn.k_proj.weight", torch.empty(256, 256, dtype=torch.float32))
        self.assertEqual(e.exception.code, dp.ERR_DTYPE)
        with self.assertRaises(dp.DecodepackError) as e:
            s.bind_weight("model.layers.1.self_attn.v_proj.weight", torch.empty(256, 512, dtype=torch.bfloat16)[:, ::2])
        self.assertEqual(e.exception.code, dp.ERR_LAYOUT)
        w13 = torch.empty(16, 256, 256, dtype=torch.bfloat16)  # vLLM's stacked [E, 2I, H]
        s.bind_expert_weights(W1, w13[:, :128, :])


class IndexerBindingTest(unittest.TestCase):
    """The indexer prefill calls on a host-only session (planning and refusals; the GPU runs are
    `decodepack indexer-run`). Bundle: kimi-k3-tiny-indexer (8 heads, top-k 2048), TP 2 with DCP 2,
    interleave 4, indexer limits 4096 keys / 16 requests, 64-key cache blocks."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="dp-python-ix-")
        cache = os.environ.get("DECODEPACK_TEST_CACHE") or os.path.join(cls.tmp, "cache")
        deploy = os.path.join(cls.tmp, "deploy.json")
        with open(deploy, "w") as f:
            json.dump({"targets": ["sm_90a"], "widths": [1], "tensor_parallel": 2, "dcp": {"size": 2, "interleave": 4},
                       "indexer": {"max_keys_per_chunk": 4096, "max_requests": 16}}, f)
        cls.path = os.path.join(cls.tmp, "ix.dpk")
        _cli("build", "--model", "kimi-k3-tiny-indexer", "--deploy", deploy, "--no-weights", "-o", cls.path,
             "--cache-dir", cache, "-j", "2")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        self.bundle = dp.Bundle(self.path)
        self.s = dp.Session(self.bundle, device=None, rank=1)

    def tearDown(self):
        self.s.close()
        self.bundle.close()

    def test_workspace(self):
        # 2^30 + 68 * ((W + 1) * (ceil(4096 / 2) + 16 * 4) + ceil(4096 / 64) * 64)
        self.assertEqual(self.bundle.info["indexer"], {"heads": 8, "top_k": 2048,
                                                       "prefill_workspace_bytes": 2**30 + 68 * (3 * 2112 + 4096)})

    def test_prepare_plans_chunks(self):
        sets = [{"seq_lens": [1, 37, 300], "query_lens": [1, 37, 5], "block_table": 0x10000, "block_table_stride": 3},
                {"seq_lens": [300], "query_lens": [300], "block_table": 0x20000, "block_table_stride": 3}]
        with self.s.indexer_prepare(sets, dcp_rank=1) as md:
            self.assertEqual(md.info["rows"], 43 + 300)
            self.assertEqual(md.info["keys"], 338 + 300)
            self.assertEqual(md.info["query_chunks"], 2)  # each set's logits fit one 1-GiB tile
        # A 12000-byte tile holds 10 rows of 300 logits: each chunk has 10 rows per rank, 20 in all, so the
        # 300 rows of the second set take 15 chunks and the first set (longest request 300) 43 / 20 -> 3.
        with self.s.indexer_prepare(sets, dcp_rank=0, max_tile_bytes=12000) as md:
            self.assertEqual(md.info["query_chunks"], 3 + 15)

    def test_prepare_refusals(self):
        # 300 keys over 2 ranks in runs of 4 need ceil(152 / 64) = 3 block-table entries per row.
        short = [{"seq_lens": [300], "query_lens": [1], "block_table": 0x10000, "block_table_stride": 2}]
        with self.assertRaises(dp.DecodepackError) as e:
            self.s.indexer_prepare(short)
        self.assertEqual(e.exception.code, dp.ERR_SHAPE)
        self.assertIn("block_table_stride 2, expected at least 3", e.exception.message)
        big = [{"seq_lens": [4000, 97], "query_lens": [1, 1], "block_table": 0x10000, "block_table_stride": 64}]
        with self.assertRaises(dp.DecodepackError) as e:
            self.s.indexer_prepare(big)
        self.assertIn("4097 keys, beyond the workspace's 4096", e.exception.message)
        with self.assertRaises(dp.DecodepackError) as e:
            self.s.indexer_prepare([dict(short[0], block_table_stride=3)], dcp_rank=2)
        self.assertEqual(e.exception.code, dp.ERR_RANK)
        with self.assertRaises(dp.DecodepackError) as e:
            self.s.indexer_prepare([dict(short[0], block_table=0x10004, block_table_stride=3)])
        self.assertEqual(e.exception.code, dp.ERR_ALIGNMENT)

    def test_prefill_checks_before_any_launch(self):
        sets = [{"seq_lens": [100], "query_lens": [10], "block_table": 0x10000, "block_table_stride": 1}]
        cache = dp.IndexerCache(0x100000, 4, 64 * 68)
        ws = self.bundle.info["indexer"]["prefill_workspace_bytes"]
        calls = []
        with self.s.indexer_prepare(sets) as md:
            args = dict(q=0x200000, weights=0x300000, out=0x400000, workspace=0x500000, workspace_bytes=ws)
            with self.assertRaises(dp.DecodepackError) as e:  # DCP 2 needs the host's all-gather
                self.s.indexer_prefill(md, cache, **args)
            self.assertEqual(e.exception.code, dp.ERR_INVALID_ARGUMENT)
            self.assertIn("all_gather is NULL", e.exception.message)
            gather = lambda *a: calls.append(a)  # noqa: E731
            with self.assertRaises(dp.DecodepackError) as e:
                self.s.indexer_prefill(md, cache, all_gather=gather, **dict(args, workspace_bytes=ws - 1))
            self.assertEqual(e.exception.code, dp.ERR_SHAPE)
            with self.assertRaises(dp.DecodepackError) as e:
                self.s.indexer_prefill(md, cache, all_gather=gather, **dict(args, out=0x400008))
            self.assertEqual(e.exception.code, dp.ERR_ALIGNMENT)
            self.assertIn("io.out", e.exception.message)
            with self.assertRaises(dp.DecodepackError) as e:
                self.s.indexer_prefill(md, dp.IndexerCache(0x100000, 4, 64 * 68 - 16), all_gather=gather, **args)
            self.assertEqual(e.exception.code, dp.ERR_LAYOUT)
            with self.assertRaises(dp.DecodepackError) as e:
                self.s.indexer_prefill(md, cache, all_gather=gather, **args)
            self.assertEqual(e.exception.code, dp.ERR_NO_DEVICE)  # everything valid: only the device is missing
        self.assertEqual(calls, [])


if __name__ == "__main__":
    unittest.main()
