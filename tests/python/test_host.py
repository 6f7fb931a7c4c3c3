"""The serving host's logic that needs no GPU (runtime/python/decodepack/host.py): the slot and block
pool, the per-row step metadata with padding, the prompt-lookup proposer and greedy acceptance. The GPU
half (the host driving the bundle and transformers) is tests/gpu/host_check.py."""

import unittest

import decodepack as dp
from decodepack.host import Pool, Request, accept, hf_weight, propose, step_metadata


class PoolTest(unittest.TestCase):
    def test_hands_out_and_takes_back_without_the_null_slot_and_block(self):
        p = Pool(5, 4)
        self.assertEqual(p.free, (4, 3))
        slots, blocks = p.take(2, 3)
        self.assertEqual((slots, blocks), ([1, 2], [1, 2, 3]))
        self.assertNotIn(dp.NULL_BLOCK_ID, slots + blocks)
        with self.assertRaisesRegex(RuntimeError, "out of KV cache: 1 slots and 1 blocks wanted, 2 and 0 free"):
            p.take(1, 1)
        p.give(slots, blocks)
        self.assertEqual(p.free, (4, 3))
        self.assertEqual(p.take(1, 1), ([1], [1]))

    def test_refuses_a_slot_or_block_returned_twice_or_never_handed_out(self):
        p = Pool(4, 4)
        s, b = p.take(1, 1)
        p.give(s, b)
        with self.assertRaisesRegex(ValueError, "slot 1 returned twice"):
            p.give(s, [])
        with self.assertRaisesRegex(ValueError, "block 0 returned twice or never handed out"):
            p.give([], [0])
        with self.assertRaisesRegex(ValueError, "null slot and block"):
            Pool(1, 4)


def request(rid, context, slots, blocks, accepted=1):
    r = Request(rid, [3] * max(context, 1), 8)
    r.context, r.slots, r.blocks, r.accepted = context, slots, blocks, accepted
    return r


class StepMetadataTest(unittest.TestCase):
    def test_rows_of_real_requests_then_padding(self):
        # block size 4: request a has 5 tokens in blocks [7, 2]; its new row (position 5) is block 2, offset 1
        a = request("a", 5, [3], [7, 2])
        b = request("b", 0, [1], [5])
        m = step_metadata([a, b], width=4, q=1, cols=3, block_size=4)
        self.assertEqual(m["state_indices"], [[3], [1], [0], [0]])
        self.assertEqual(m["block_table"], [[7, 2, 0], [5, 0, 0], [0, 0, 0], [0, 0, 0]])
        self.assertEqual(m["seq_lens"], [6, 1, 0, 0])
        self.assertEqual(m["positions"], [5, 0, 0, 0])
        self.assertEqual(m["slot_mapping"], [2 * 4 + 1, 5 * 4 + 0, dp.PAD_SLOT_ID, dp.PAD_SLOT_ID])
        self.assertEqual(m["num_accepted"], [1, 1, 1, 1])

    def test_speculative_rows_and_accepted_counts(self):
        # q = 2: two rows per request (positions 3 and 4, crossing from block 9 into block 4)
        a = request("a", 3, [2, 6], [9, 4], accepted=2)
        m = step_metadata([a], width=2, q=2, cols=2, block_size=4)
        self.assertEqual(m["state_indices"], [[2, 6], [0, 0]])
        self.assertEqual(m["positions"], [3, 4, 0, 0])
        self.assertEqual(m["slot_mapping"], [9 * 4 + 3, 4 * 4 + 0, dp.PAD_SLOT_ID, dp.PAD_SLOT_ID])
        self.assertEqual(m["seq_lens"], [5, 0])
        self.assertEqual(m["num_accepted"], [2, 1])

    def test_more_requests_than_the_width_is_a_host_bug(self):
        with self.assertRaisesRegex(ValueError, "2 requests at width 1"):
            step_metadata([request("a", 1, [1], [1]), request("b", 1, [2], [2])], width=1, q=1, cols=1, block_size=4)


class ProposeAcceptTest(unittest.TestCase):
    def test_prompt_lookup(self):
        self.assertEqual(propose([5, 8, 1, 5]), 8)          # 8 followed the previous 5
        self.assertEqual(propose([5, 8, 5, 9, 5]), 9)       # the latest occurrence wins
        self.assertEqual(propose([4, 7]), 7)                # no earlier occurrence: repeat

    def test_greedy_acceptance(self):
        # fed [last, proposal]; argmaxes after each
        self.assertEqual(accept([10, 11], [11, 12]), [11, 12])   # proposal right: it and the next choice
        self.assertEqual(accept([10, 11], [13, 12]), [13])       # proposal wrong: the model's own choice
        self.assertEqual(accept([10], [7]), [7])                 # q = 1

    def test_empty_prompt_refused(self):
        with self.assertRaisesRegex(ValueError, "empty prompt"):
            Request("x", [], 4)


class Fake:
    """A stand-in for a tensor: its name, shape and the index it was sliced with."""

    def __init__(self, name, shape, index=None):
        self.name, self.shape, self.index = name, shape, index

    def __getitem__(self, index):
        return Fake(self.name, None, index)


class HfWeightTest(unittest.TestCase):
    """Bundle weight names (checkpoint naming) onto transformers 5.17's fused runtime tensors."""

    def setUp(self):
        L = "model.layers.1."
        self.p = {n: Fake(n, s) for n, s in (
            (L + "self_attn.conv1d.weight", (3 * 256, 1, 4)),
            (L + "self_attn.forget_gate.f_a_proj.weight", (128, 256)),
            (L + "mlp.experts.gate_up_proj", (16, 2 * 128, 256)),
            (L + "mlp.experts.down_proj", (16, 256, 128)),
            (L + "mlp.gate.weight", (16, 256)),
            ("model.norm.weight", (256,)))}

    def test_mapping(self):
        L = "model.layers.1."
        t, src = hf_weight(L + "self_attn.k_conv1d.weight", self.p)
        self.assertEqual((t.name, t.index, src), (L + "self_attn.conv1d.weight", slice(256, 512),
                                                  L + "self_attn.conv1d.weight[256:512]"))
        t, src = hf_weight(L + "self_attn.f_a_proj.weight", self.p)
        self.assertEqual(src, L + "self_attn.forget_gate.f_a_proj.weight")
        t, src = hf_weight(L + "block_sparse_moe.experts.{e}.w1.weight", self.p)   # gate: first half
        self.assertEqual(t.index, (slice(None), slice(None, 128), slice(None)))
        t, src = hf_weight(L + "block_sparse_moe.experts.{e}.w3.weight", self.p)   # up: second half
        self.assertEqual(t.index, (slice(None), slice(128, None), slice(None)))
        t, src = hf_weight(L + "block_sparse_moe.experts.{e}.w2.weight", self.p)
        self.assertEqual((t.index, src), (None, L + "mlp.experts.down_proj"))
        self.assertEqual(hf_weight(L + "block_sparse_moe.gate.weight", self.p)[1], L + "mlp.gate.weight")
        self.assertEqual(hf_weight("model.norm.weight", self.p)[1], "model.norm.weight")
        with self.assertRaises(KeyError):
            hf_weight(L + "self_attn.o_proj.weight", self.p)


if __name__ == "__main__":
    unittest.main()
