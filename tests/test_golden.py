"""Golden tests of lowered code: what print(pipe) and pipe.code() show is pinned (forward,
backward and layer-grain stages), and stable across processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn
from expecttest import TestCase

import fxpipe
from tests import models

ROOT = Path(__file__).resolve().parents[1]


def normalized(text: str) -> str:
    """Strip what depends on paths, object ids or the torch version from generated code."""
    text = re.sub(r"0x[0-9a-f]+", "0x?", text)
    text = text.replace(str(ROOT), "<repo>")
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def stage_code(pipe, i: int) -> str:
    return normalized(pipe.stages[i].code)


class TinyChain(nn.Module):
    """Two blocks with a carried mask and a skip from the input."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x, mask):
        h = self.inp(x)
        for b in self.blocks:
            h = torch.relu(b(h)) * mask
        return h + x


class TestGolden(TestCase):
    def test_tiny_chain_program(self):
        torch.manual_seed(0)
        pipe = fxpipe.compile(TinyChain(), example_inputs=(torch.randn(2, 4), torch.ones(2, 4)))
        self.assertExpectedInline(normalized(str(pipe)), """\
# PipelineModule: 4 layers on vcpu:0, vcpu:1; plan fwd [0:2, 2:3] bwd [3:4, 2:3, 1:2, 0:1]
# what pipe(x) runs: its Program's actions in an order they allow; pipe.program(run_type) prints
# a call's lanes, pipe.code(run_type) its stages' code
def forward(self, x, mask):
    x_0, x_1, x_2, mask_0, mask_1, mask_2 = split(x, mask, 3)  # the caller's inputs, 3 microbatches
    refresh()                                                 # RF host
    # stage 0 fwd | layers 0-1 (prefix, blocks.0) | vcpu:0 | params 160 B | saved 128 B | out 96 B | fwd 128 FLOP | bwd 192 FLOP
    params_0 = prefetch(self.stage_0, 'vcpu:0')               # 0P vcpu:0
    # stage 1 fwd | layer 2 (blocks.1) | vcpu:1 | params 80 B | saved 32 B | out 96 B | fwd 64 FLOP | bwd 128 FLOP
    params_1 = prefetch(self.stage_1, 'vcpu:1')               # 1P vcpu:1
    x_0_d0, mask_0_d0 = upload(x_0, mask_0, 'vcpu:0')         # 0U0 vcpu:0
    mul_0_d0 = self.stage_0(params_0, x_0_d0, mask_0_d0)      # 0F0 vcpu:0
    mul_0 = offload(mul_0_d0)                                 # 0O0 vcpu:0
    free(x_0_d0, mask_0_d0, mul_0_d0)                         # 0X0 vcpu:0
    mul_0_d1 = upload(mul_0, 'vcpu:1')                        # 1U0 vcpu:1
    # stage 2 fwd | layer 3 (suffix) | vcpu:0 | params 0 B | saved 64 B | out 32 B | fwd 0 FLOP | bwd 0 FLOP
    params_2 = prefetch(self.stage_2, 'vcpu:0')               # 2P vcpu:0
    linear_2_0_d1 = self.stage_1(params_1, mul_0_d1)          # 1F0 vcpu:1
    x_1_d0, mask_1_d0 = upload(x_1, mask_1, 'vcpu:0')         # 0U1 vcpu:0
    linear_2_0 = offload(linear_2_0_d1)                       # 1O0 vcpu:1
    mul_1_d0 = self.stage_0(params_0, x_1_d0, mask_1_d0)      # 0F1 vcpu:0
    free(mul_0_d1, linear_2_0_d1)                             # 1X0 vcpu:1
    mul_1 = offload(mul_1_d0)                                 # 0O1 vcpu:0
    free(x_1_d0, mask_1_d0, mul_1_d0)                         # 0X1 vcpu:0
    mul_1_d1 = upload(mul_1, 'vcpu:1')                        # 1U1 vcpu:1
    x_2_d0, mask_2_d0 = upload(x_2, mask_2, 'vcpu:0')         # 0U2 vcpu:0
    linear_2_1_d1 = self.stage_1(params_1, mul_1_d1)          # 1F1 vcpu:1
    mul_2_d0 = self.stage_0(params_0, x_2_d0, mask_2_d0)      # 0F2 vcpu:0
    linear_2_1 = offload(linear_2_1_d1)                       # 1O1 vcpu:1
    mul_2 = offload(mul_2_d0)                                 # 0O2 vcpu:0
    free(mul_1_d1, linear_2_1_d1)                             # 1X1 vcpu:1
    free(x_2_d0, mask_2_d0, mul_2_d0)                         # 0X2 vcpu:0
    mul_2_d1 = upload(mul_2, 'vcpu:1')                        # 1U2 vcpu:1
    x_0_d0, mask_0_d0, linear_2_0_d0 = upload(x_0, mask_0, linear_2_0, 'vcpu:0')  # 2U0 vcpu:0
    linear_2_2_d1 = self.stage_1(params_1, mul_2_d1)          # 1F2 vcpu:1
    release(params_0)                                         # 0R vcpu:0
    linear_2_2 = offload(linear_2_2_d1)                       # 1O2 vcpu:1
    add_0_d0 = self.stage_2(params_2, x_0_d0, mask_0_d0, linear_2_0_d0)  # 2F0 vcpu:0
    free(mul_2_d1, linear_2_2_d1)                             # 1X2 vcpu:1
    add_0 = offload(add_0_d0)                                 # 2O0 vcpu:0
    release(params_1)                                         # 1R vcpu:1
    free(x_0_d0, mask_0_d0, linear_2_0_d0, add_0_d0)          # 2X0 vcpu:0
    x_1_d0, mask_1_d0, linear_2_1_d0 = upload(x_1, mask_1, linear_2_1, 'vcpu:0')  # 2U1 vcpu:0
    add_1_d0 = self.stage_2(params_2, x_1_d0, mask_1_d0, linear_2_1_d0)  # 2F1 vcpu:0
    add_1 = offload(add_1_d0)                                 # 2O1 vcpu:0
    free(x_1_d0, mask_1_d0, linear_2_1_d0, add_1_d0)          # 2X1 vcpu:0
    x_2_d0, mask_2_d0, linear_2_2_d0 = upload(x_2, mask_2, linear_2_2, 'vcpu:0')  # 2U2 vcpu:0
    add_2_d0 = self.stage_2(params_2, x_2_d0, mask_2_d0, linear_2_2_d0)  # 2F2 vcpu:0
    add_2 = offload(add_2_d0)                                 # 2O2 vcpu:0
    free(x_2_d0, mask_2_d0, linear_2_2_d0, add_2_d0)          # 2X2 vcpu:0
    release(params_2)                                         # 2R vcpu:0
    return commit(add_0, add_1, add_2)                        # C host""")

    def test_backward_stage_and_layer_piece(self):
        """A backward stage (recomputed, its linear tail skipped) and, at layer grain, the
        piece of it that one layer's backward runs: what the runtime executes."""
        torch.manual_seed(0)
        plan = fxpipe.ExecutePlan([range(0, 2)], [range(2, 4), range(0, 2)])
        pipe = fxpipe.compile(TinyChain(), example_inputs=(torch.randn(2, 4), torch.ones(2, 4)),
                              plan=plan)
        stage = pipe._executable("fused").stages[2]
        self.assertExpectedInline(normalized(stage.code), """\
def forward(self, x, mask):
    # stage 2 bwd | layers 0-1 (prefix, blocks.0) | vcpu:0 | params 160 B | saved 128 B | out 96 B | fwd 128 FLOP | bwd 192 FLOP
    host_inp_weight = self.inp.weight
    host_inp_bias = self.inp.bias
    host_blocks_0_weight = getattr(self.blocks, "0").weight
    host_blocks_0_bias = getattr(self.blocks, "0").bias
    params = torch.ops.fxpipe.prefetch.default([host_inp_weight, host_inp_bias, host_blocks_0_weight, host_blocks_0_bias], 2, 0);  host_inp_weight = host_inp_bias = host_blocks_0_weight = host_blocks_0_bias = None
    inp_weight = params[0]
    inp_bias = params[1]
    blocks_0_weight = params[2]
    blocks_0_bias = params[3]
    x_dev = torch.ops.fxpipe.upload.default(x, 0);  x = None
    mask_dev = torch.ops.fxpipe.upload.default(mask, 0);  mask = None
    linear = torch._C._nn.linear(x_dev, inp_weight, inp_bias);  x_dev = inp_weight = inp_bias = None
    linear_1 = torch._C._nn.linear(linear, blocks_0_weight, blocks_0_bias);  linear = blocks_0_weight = blocks_0_bias = None
    relu = torch.relu(linear_1);  linear_1 = None
    mul = relu * mask_dev;  relu = mask_dev = None
    mul_host = torch.ops.fxpipe.offload.default(mul);  mul = None
    release = torch.ops.fxpipe.release.default(params, 2);  params = release = None
    return (mul_host,)""")
        piece = pipe._executable("fused", grain="layer").pieces[(2, 1)]
        self.assertExpectedInline(normalized(piece.code), """\
def forward(self, mask, linear):
    # stage 2 bwd piece | layer 1 (blocks.0) | vcpu:0 | params 80 B | saved 96 B | out 96 B | fwd 64 FLOP | bwd 128 FLOP
    host_blocks_0_weight = getattr(self.blocks, "0").weight
    host_blocks_0_bias = getattr(self.blocks, "0").bias
    params = torch.ops.fxpipe.prefetch.default([host_blocks_0_weight, host_blocks_0_bias], 2, 0);  host_blocks_0_weight = host_blocks_0_bias = None
    blocks_0_weight = params[0]
    blocks_0_bias = params[1]
    mask_dev = torch.ops.fxpipe.upload.default(mask, 0);  mask = None
    linear_dev = torch.ops.fxpipe.upload.default(linear, 0);  linear = None
    linear_1 = torch._C._nn.linear(linear_dev, blocks_0_weight, blocks_0_bias);  linear_dev = blocks_0_weight = blocks_0_bias = None
    relu = torch.relu(linear_1);  linear_1 = None
    mul = relu * mask_dev;  relu = mask_dev = None
    mul_host = torch.ops.fxpipe.offload.default(mul);  mul = None
    release = torch.ops.fxpipe.release.default(params, 2);  params = release = None
    return (mul_host,)""")

    def test_mlp_stage(self):
        torch.manual_seed(0)
        pipe = fxpipe.compile(models.mlp(width=8, depth=2), example_inputs=(torch.randn(4, 8),))
        self.assertExpectedInline(stage_code(pipe, 0), """\
def forward(self, input_1):
    # stage 0 fwd | layer 0 (0) | vcpu:0 | params 288 B | saved 128 B | out 128 B | fwd 512 FLOP | bwd 512 FLOP
    host_0_weight = getattr(self, "0").weight
    host_0_bias = getattr(self, "0").bias
    params = torch.ops.fxpipe.prefetch.default([host_0_weight, host_0_bias], 0, 0);  host_0_weight = host_0_bias = None
    _0_weight = params[0]
    _0_bias = params[1]
    input_1_dev = torch.ops.fxpipe.upload.default(input_1, 0);  input_1 = None
    linear = torch._C._nn.linear(input_1_dev, _0_weight, _0_bias);  input_1_dev = _0_weight = _0_bias = None
    linear_host = torch.ops.fxpipe.offload.default(linear);  linear = None
    release = torch.ops.fxpipe.release.default(params, 0);  params = release = None
    return (linear_host,)""")

    def test_gpt_block_stage(self):
        torch.manual_seed(0)
        pipe = fxpipe.compile(models.GPT(depth=2, dim=16, heads=2).eval(),
                              example_inputs=(torch.randint(0, 64, (2, 8)),))
        self.assertExpectedInline(stage_code(pipe, 1), """\
def forward(self, to, to_1, add_5):
    # stage 1 fwd | layer 2 (blocks.1) | vcpu:1 | params 12.7 kB | saved 21.2 kB | out 1.02 kB | fwd 106 kFLOP | bwd 217 kFLOP
    host_blocks_1_norm1_weight = getattr(self.blocks, "1").norm1.weight
    host_blocks_1_qkv_weight = getattr(self.blocks, "1").qkv.weight
    host_blocks_1_proj_weight = getattr(self.blocks, "1").proj.weight
    host_blocks_1_norm2_weight = getattr(self.blocks, "1").norm2.weight
    host_blocks_1_up_weight = getattr(self.blocks, "1").up.weight
    host_blocks_1_up_bias = getattr(self.blocks, "1").up.bias
    host_blocks_1_down_weight = getattr(self.blocks, "1").down.weight
    host_blocks_1_down_bias = getattr(self.blocks, "1").down.bias
    params = torch.ops.fxpipe.prefetch.default([host_blocks_1_norm1_weight, host_blocks_1_qkv_weight, host_blocks_1_proj_weight, host_blocks_1_norm2_weight, host_blocks_1_up_weight, host_blocks_1_up_bias, host_blocks_1_down_weight, host_blocks_1_down_bias], 1, 1);  host_blocks_1_norm1_weight = host_blocks_1_qkv_weight = host_blocks_1_proj_weight = host_blocks_1_norm2_weight = host_blocks_1_up_weight = host_blocks_1_up_bias = host_blocks_1_down_weight = host_blocks_1_down_bias = None
    blocks_1_norm1_weight = params[0]
    blocks_1_qkv_weight = params[1]
    blocks_1_proj_weight = params[2]
    blocks_1_norm2_weight = params[3]
    blocks_1_up_weight = params[4]
    blocks_1_up_bias = params[5]
    blocks_1_down_weight = params[6]
    blocks_1_down_bias = params[7]
    to_dev = torch.ops.fxpipe.upload.default(to, 1);  to = None
    to_1_dev = torch.ops.fxpipe.upload.default(to_1, 1);  to_1 = None
    add_5_dev = torch.ops.fxpipe.upload.default(add_5, 1);  add_5 = None
    getattr_5 = add_5_dev.shape
    getitem_11 = getattr_5[0]
    getitem_12 = getattr_5[1]
    getitem_13 = getattr_5[2];  getattr_5 = None
    pow_4 = add_5_dev.pow(2)
    mean_2 = pow_4.mean(-1, keepdim = True);  pow_4 = None
    add_6 = mean_2 + 1e-06;  mean_2 = None
    rsqrt_2 = torch.rsqrt(add_6);  add_6 = None
    mul_8 = add_5_dev * rsqrt_2;  rsqrt_2 = None
    mul_9 = mul_8 * blocks_1_norm1_weight;  mul_8 = blocks_1_norm1_weight = None
    linear_4 = torch._C._nn.linear(mul_9, blocks_1_qkv_weight, None);  mul_9 = blocks_1_qkv_weight = None
    split_1 = linear_4.split(getitem_13, dim = -1);  linear_4 = None
    getitem_14 = split_1[0]
    getitem_15 = split_1[1]
    getitem_16 = split_1[2];  split_1 = None
    floordiv_3 = getitem_13 // 2
    view_3 = getitem_14.view(getitem_11, getitem_12, 2, floordiv_3);  getitem_14 = floordiv_3 = None
    transpose_4 = view_3.transpose(1, 2);  view_3 = None
    floordiv_4 = getitem_13 // 2
    view_4 = getitem_15.view(getitem_11, getitem_12, 2, floordiv_4);  getitem_15 = floordiv_4 = None
    transpose_5 = view_4.transpose(1, 2);  view_4 = None
    floordiv_5 = getitem_13 // 2
    view_5 = getitem_16.view(getitem_11, getitem_12, 2, floordiv_5);  getitem_16 = floordiv_5 = None
    transpose_6 = view_5.transpose(1, 2);  view_5 = None
    chunk_2 = transpose_4.chunk(2, dim = -1)
    getitem_17 = chunk_2[0]
    getitem_18 = chunk_2[1];  chunk_2 = None
    mul_10 = transpose_4 * to_dev;  transpose_4 = None
    neg_2 = -getitem_18;  getitem_18 = None
    cat_3 = torch.cat([neg_2, getitem_17], dim = -1);  neg_2 = getitem_17 = None
    mul_11 = cat_3 * to_1_dev;  cat_3 = None
    add_7 = mul_10 + mul_11;  mul_10 = mul_11 = None
    chunk_3 = transpose_5.chunk(2, dim = -1)
    getitem_19 = chunk_3[0]
    getitem_20 = chunk_3[1];  chunk_3 = None
    mul_12 = transpose_5 * to_dev;  transpose_5 = to_dev = None
    neg_3 = -getitem_20;  getitem_20 = None
    cat_4 = torch.cat([neg_3, getitem_19], dim = -1);  neg_3 = getitem_19 = None
    mul_13 = cat_4 * to_1_dev;  cat_4 = to_1_dev = None
    add_8 = mul_12 + mul_13;  mul_12 = mul_13 = None
    scaled_dot_product_attention_1 = torch._C._nn.scaled_dot_product_attention(add_7, add_8, transpose_6, is_causal = True);  add_7 = add_8 = transpose_6 = None
    transpose_7 = scaled_dot_product_attention_1.transpose(1, 2);  scaled_dot_product_attention_1 = None
    reshape_1 = transpose_7.reshape(getitem_11, getitem_12, getitem_13);  transpose_7 = getitem_11 = getitem_12 = getitem_13 = None
    linear_5 = torch._C._nn.linear(reshape_1, blocks_1_proj_weight, None);  reshape_1 = blocks_1_proj_weight = None
    dropout_2 = torch.nn.functional.dropout(linear_5, p = 0.0, training = False, inplace = False);  linear_5 = None
    add_9 = add_5_dev + dropout_2;  add_5_dev = dropout_2 = None
    pow_5 = add_9.pow(2)
    mean_3 = pow_5.mean(-1, keepdim = True);  pow_5 = None
    add_10 = mean_3 + 1e-06;  mean_3 = None
    rsqrt_3 = torch.rsqrt(add_10);  add_10 = None
    mul_14 = add_9 * rsqrt_3;  rsqrt_3 = None
    mul_15 = mul_14 * blocks_1_norm2_weight;  mul_14 = blocks_1_norm2_weight = None
    linear_6 = torch._C._nn.linear(mul_15, blocks_1_up_weight, blocks_1_up_bias);  mul_15 = blocks_1_up_weight = blocks_1_up_bias = None
    gelu_1 = torch._C._nn.gelu(linear_6);  linear_6 = None
    linear_7 = torch._C._nn.linear(gelu_1, blocks_1_down_weight, blocks_1_down_bias);  gelu_1 = blocks_1_down_weight = blocks_1_down_bias = None
    dropout_3 = torch.nn.functional.dropout(linear_7, p = 0.0, training = False, inplace = False);  linear_7 = None
    add_11 = add_9 + dropout_3;  add_9 = dropout_3 = None
    add_11_host = torch.ops.fxpipe.offload.default(add_11);  add_11 = None
    release = torch.ops.fxpipe.release.default(params, 1);  params = release = None
    return (add_11_host,)""")

    def test_batchnorm_stage_writes_back_running_stats(self):
        torch.manual_seed(0)
        pipe = fxpipe.compile(models.ConvNet(c=2, depth=1).train(),
                              example_inputs=(torch.randn(2, 3, 4, 4),))
        self.assertExpectedInline(stage_code(pipe, 1), """\
def forward(self, relu_2):
    # stage 1 fwd | layer 2 (suffix) | vcpu:1 | params 120 B | saved 16 B | out 80 B | fwd 80 FLOP | bwd 160 FLOP
    host_fc_weight = self.fc.weight
    host_fc_bias = self.fc.bias
    params = torch.ops.fxpipe.prefetch.default([host_fc_weight, host_fc_bias], 1, 1);  host_fc_weight = host_fc_bias = None
    fc_weight = params[0]
    fc_bias = params[1]
    relu_2_dev = torch.ops.fxpipe.upload.default(relu_2, 1);  relu_2 = None
    mean = torch.ops.aten.mean.dim(relu_2_dev, [2, 3]);  relu_2_dev = None
    linear = torch.ops.aten.linear.default(mean, fc_weight, fc_bias);  mean = fc_weight = fc_bias = None
    linear_host = torch.ops.fxpipe.offload.default(linear);  linear = None
    release = torch.ops.fxpipe.release.default(params, 1);  params = release = None
    return (linear_host,)""")


SCRIPT = """
import torch, fxpipe
from tests import models
from tests.test_golden import normalized
torch.manual_seed(0)
pipe = fxpipe.compile(models.GPT(depth=2, dim=16, heads=2).eval(), example_inputs=(torch.randint(0, 64, (2, 8)),))
print(normalized(pipe.code("fused")))
"""


def test_printed_program_is_stable_across_processes():
    outs = []
    for seed in ("0", "1234"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT))
        res = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        outs.append(res.stdout)
    assert outs[0] == outs[1]
    assert "torch.ops.fxpipe.prefetch.default" in outs[0]
