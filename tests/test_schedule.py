"""Programs: golden printed schedules, text round-trip, builder invariants, dependency rules."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import expecttest
import pytest

from fxpipe.passes.schedule import (HOST, DownloadGrads, Forward, Free, FusedBackward, Offload,
                                    OptimizerStep, Prefetch, Program, RecomputeBackward, Release,
                                    StageSpec, Upload, UploadGrad, build_program, parse_action)

FUSED_6 = ([range(0, 2), range(2, 4)], [range(4, 6), range(2, 4), range(0, 2)])
TRAIN_6 = ([range(0, 2), range(2, 4), range(4, 6)], [range(3, 6), range(0, 3)])


def deps_text(program: Program, device: int, steps: range) -> str:
    """Dependencies of some steps of one device, one line each: ``action <- dep, ...``."""
    deps = program.dependencies()[device]
    lines = []
    for i in steps:
        parts = [f"{program.lane(x.device)[x.step]}@d{x.device}.{x.on}({x.why}"
                 f"{', hop' if x.hop else ''})" for x in deps[i]]
        lines.append(f"{program.actions[device][i]} <- {' '.join(parts) or '-'}"
                     if len(parts) < 4 else f"{program.actions[device][i]} <-\n    "
                     + "\n    ".join(parts))
    return "\n".join(lines)


def plans(num_layers: int, run_type: str):
    """A deterministic family of valid plans over ``num_layers`` layers."""
    for f_cut, b_cut in itertools.product(range(1, num_layers), repeat=2):
        if run_type == "fused":
            tail = num_layers - 1
            fwd = [range(0, min(f_cut, tail)), range(min(f_cut, tail), tail)]
            bwd = [range(tail, num_layers), range(b_cut % tail, tail), range(0, b_cut % tail)]
        else:
            fwd = [range(0, f_cut), range(f_cut, num_layers)]
            bwd = [range(b_cut, num_layers), range(0, b_cut)]
        yield [r for r in fwd if len(r)], [r for r in bwd if len(r)]


class TestGolden(expecttest.TestCase):
    def test_stage_dispatch_fused_2_devices(self):
        p = build_program(*FUSED_6, "fused", 2, 2, "stage")
        self.assertExpectedInline(str(p), """\
program devices=2 microbatches=2
inputs input <label>
stage 0 fwd 0:2 reads=input makes=l1
stage 1 fwd 2:4 reads=l1 makes=l3
stage 2 fused 4:6 reads=l3,<label> makes=l5
stage 3 bwd 2:4 reads=l1 makes=l3
stage 4 bwd 0:2 reads=input makes=l1
step d0   d1  host
0    0P   1P  RF
1    0U0  1U0 M4:6
2    0F0  1F0 M2:4
3    0O0  1O0 M0:2
4    0X0  1X0 C
5    2P   3P  .
6    0U1  1U1 .
7    0F1  1F1 .
8    0O1  1O1 .
9    0X1  1X1 .
10   2U0  3U0 .
11   0R   3G0 .
12   2FB0 1R  .
13   2O0  3B0 .
14   2X0  3O0 .
15   4P   3X0 .
16   2U1  3U1 .
17   2FB1 3G1 .
18   2O1  3B1 .
19   2X1  3O1 .
20   4U0  3X1 .
21   4G0  3D  .
22   2D   3R  .
23   2R   .   .
24   4B0  .   .
25   4X0  .   .
26   4U1  .   .
27   4G1  .   .
28   4B1  .   .
29   4X1  .   .
30   4D   .   .
31   4R   .   .""")

    def test_stage_dispatch_train_3_devices(self):
        p = build_program(*TRAIN_6, "train", 3, 2, "stage")
        self.assertExpectedInline(str(p), """\
program devices=3 microbatches=2
inputs input
outputs l5
stage 0 fwd 0:2 reads=input makes=l1
stage 1 fwd 2:4 reads=l1 makes=l3,l2
stage 2 fwd 4:6 reads=l3 makes=l5
stage 3 bwd 3:6 reads=l2 makes=l5
stage 4 bwd 0:3 reads=input makes=l2
step d0  d1  d2  host
0    0P  1P  2P  RF
1    0U0 1U0 2U0 C
2    0F0 1F0 2F0 M3:6
3    0O0 1O0 2O0 M0:3
4    0X0 1X0 2X0 .
5    3P  4P  2U1 .
6    0U1 1U1 2F1 .
7    0F1 1F1 2O1 .
8    0O1 1O1 2X1 .
9    0X1 1X1 2R  .
10   3U0 4U0 .   .
11   3G0 4G0 .   .
12   0R  1R  .   .
13   3B0 4B0 .   .
14   3O0 4X0 .   .
15   3X0 4U1 .   .
16   3U1 4G1 .   .
17   3G1 4B1 .   .
18   3B1 4X1 .   .
19   3O1 4D  .   .
20   3X1 4R  .   .
21   3D  .   .   .
22   3R  .   .   .""")

    def test_roundpipe_dispatch_fused_3_devices(self):
        # rounds {0,1,2} and {3}; without timing, round 2 starts where round 1 left off
        p = build_program(*FUSED_6, "fused", 3, 4, "roundpipe")
        self.assertExpectedInline(str(p), """\
program devices=3 microbatches=4
inputs input <label>
stage 0 fwd 0:2 reads=input makes=l1
stage 1 fwd 2:4 reads=l1 makes=l3
stage 2 fused 4:6 reads=l3,<label> makes=l5
stage 3 bwd 2:4 reads=l1 makes=l3
stage 4 bwd 0:2 reads=input makes=l1
step d0  d1   d2   host
0    0P  1P   2P   RF
1    0U0 1U0  2U0  M4:6
2    0F0 1F0  2FB0 M2:4
3    0O0 1O0  2O0  M0:2
4    0X0 1X0  2X0  C
5    3P  4P   0P   .
6    0U1 1U1  2U1  .
7    0F1 1F1  2FB1 .
8    0O1 1O1  2O1  .
9    0X1 1X1  2X1  .
10   0U2 1U2  2U2  .
11   0F2 1F2  2FB2 .
12   0O2 1O2  2O2  .
13   0X2 1X2  2X2  .
14   3U0 4U0  0U3  .
15   3G0 4G0  2D   .
16   0R  1R   2R   .
17   3B0 4B0  0F3  .
18   3O0 4X0  0O3  .
19   3X0 2P   0X3  .
20   1P  4U1  3P   .
21   3U1 4G1  3U3  .
22   3G1 4B1  3G3  .
23   3B1 4X1  0R   .
24   3O1 4U2  3B3  .
25   3X1 4G2  3O3  .
26   3U2 4B2  3X3  .
27   3G2 4X2  3D   .
28   3B2 2U3  3R   .
29   3O2 4D   .    .
30   3X2 4R   .    .
31   1U3 2FB3 .    .
32   3D  2O3  .    .
33   3R  2X3  .    .
34   1F3 2D   .    .
35   1O3 2R   .    .
36   1X3 .    .    .
37   4P  .    .    .
38   4U3 .    .    .
39   4G3 .    .    .
40   1R  .    .    .
41   4B3 .    .    .
42   4X3 .    .    .
43   4D  .    .    .
44   4R  .    .    .""")

    def test_roundpipe_dispatch_train_2_devices_with_optimizer(self):
        p = build_program(*TRAIN_6, "train", 2, 2, "roundpipe", optimizer=True)
        self.assertExpectedInline(str(p), """\
program devices=2 microbatches=2
inputs input
outputs l5
stage 0 fwd 0:2 reads=input makes=l1
stage 1 fwd 2:4 reads=l1 makes=l3,l2
stage 2 fwd 4:6 reads=l3 makes=l5
stage 3 bwd 3:6 reads=l2 makes=l5
stage 4 bwd 0:3 reads=input makes=l2
step d0  d1  host
0    0P  1P  RF
1    0U0 1U0 C
2    0F0 1F0 S3:6
3    0O0 1O0 S0:3
4    0X0 1X0 .
5    2P  3P  .
6    0U1 1U1 .
7    0F1 1F1 .
8    0O1 1O1 .
9    0X1 1X1 .
10   2U0 3U0 .
11   0R  3G0 .
12   2F0 1R  .
13   2O0 3B0 .
14   2X0 3O0 .
15   4P  3X0 .
16   2U1 3U1 .
17   2F1 3G1 .
18   2O1 3B1 .
19   2X1 3O1 .
20   4U0 3X1 .
21   4G0 3D  .
22   2R  3R  .
23   4B0 .   .
24   4X0 .   .
25   4U1 .   .
26   4G1 .   .
27   4B1 .   .
28   4X1 .   .
29   4D  .   .
30   4R  .   .""")

    def test_roundpipe_forward_lead_and_split_head(self):
        # round 1's forwards go with round 0's backwards; the fused stage 2 takes two
        # slots per round (even / odd microbatches)
        p = build_program(*FUSED_6, "fused", 3, 4, "roundpipe", round_size=2, forward_lead=1,
                          split_stages=(2,))
        jobs = [" ".join(str(a) for a in acts if isinstance(a, (Forward, FusedBackward,
                                                                 RecomputeBackward)))
                for acts in p.actions]
        self.assertExpectedInline("\n".join(jobs), """\
0F0 0F1 1F2 1F3 3B0 3B1 2FB3
1F0 1F1 2FB0 4B0 4B1 3B2 3B3
0F2 0F3 2FB1 2FB2 4B2 4B3""")

    def test_infer_2_devices(self):
        p = build_program([range(0, 1), range(1, 2), range(2, 3)], [], "infer", 2, 2, "stage")
        self.assertExpectedInline(str(p), """\
program devices=2 microbatches=2
inputs input
outputs l2
stage 0 fwd 0:1 reads=input makes=l0
stage 1 fwd 1:2 reads=l0 makes=l1
stage 2 fwd 2:3 reads=l1 makes=l2
step d0  d1  host
0    0P  1P  RF
1    0U0 1U0 C
2    0F0 1F0 .
3    0O0 1O0 .
4    0X0 1X0 .
5    2P  1U1 .
6    0U1 1F1 .
7    0F1 1O1 .
8    0O1 1X1 .
9    0X1 1R  .
10   2U0 .   .
11   0R  .   .
12   2F0 .   .
13   2O0 .   .
14   2X0 .   .
15   2U1 .   .
16   2F1 .   .
17   2O1 .   .
18   2X1 .   .
19   2R  .   .""")

    def test_dependency_rules(self):
        p = build_program(*FUSED_6, "fused", 2, 2, "stage")
        self.assertExpectedInline(deps_text(p, 0, range(len(p.actions[0]))), """\
0P <- RF@d-1.end(refresh)
0U0 <- -
0F0 <- 0P@d0.end(params) 0U0@d0.end(input)
0O0 <- 0F0@d0.end(input)
0X0 <- 0F0@d0.end(free) 0O0@d0.end(free)
2P <- 0P@d0.end(stream) 0F0@d0.start(issue) RF@d-1.end(refresh)
0U1 <- 0U0@d0.end(stream) 0F0@d0.start(issue)
0F1 <- 0F0@d0.end(stream) 0P@d0.end(params) 0U1@d0.end(input)
0O1 <- 0O0@d0.end(stream) 0F1@d0.end(input)
0X1 <- 0X0@d0.end(stream) 0F1@d0.end(free) 0O1@d0.end(free)
2U0 <- 0U1@d0.end(stream) 0F1@d0.start(issue) 1O0@d1.end(input, hop)
0R <- 0F1@d0.end(job)
2FB0 <- 0F1@d0.end(stream) 2P@d0.end(params) 2U0@d0.end(input)
2O0 <- 0O1@d0.end(stream) 2FB0@d0.end(input)
2X0 <- 0X1@d0.end(stream) 2FB0@d0.end(free) 2O0@d0.end(free)
4P <-
    2P@d0.end(stream)
    2FB0@d0.start(issue)
    0R@d0.end(release)
    RF@d-1.end(refresh)
2U1 <- 2U0@d0.end(stream) 2FB0@d0.start(issue) 1O1@d1.end(input, hop)
2FB1 <- 2FB0@d0.end(stream) 2P@d0.end(params) 2U1@d0.end(input)
2O1 <- 2O0@d0.end(stream) 2FB1@d0.end(input)
2X1 <- 2X0@d0.end(stream) 2FB1@d0.end(free) 2O1@d0.end(free)
4U0 <- 2U1@d0.end(stream) 2FB1@d0.start(issue)
4G0 <- 4U0@d0.end(stream) 2FB1@d0.start(issue) 3O0@d1.end(grad, hop)
2D <- 2FB1@d0.end(job)
2R <- 0R@d0.end(stream) 2FB1@d0.end(job) 2D@d0.end(job)
4B0 <-
    2FB1@d0.end(stream)
    4P@d0.end(params)
    4U0@d0.end(input)
    4G0@d0.end(grad)
4X0 <- 2X1@d0.end(stream) 4B0@d0.end(free)
4U1 <- 4G0@d0.end(stream) 4B0@d0.start(issue)
4G1 <- 4U1@d0.end(stream) 4B0@d0.start(issue) 3O1@d1.end(grad, hop)
4B1 <-
    4B0@d0.end(stream)
    4P@d0.end(params)
    4U1@d0.end(input)
    4G1@d0.end(grad)
4X1 <- 4X0@d0.end(stream) 4B1@d0.end(free)
4D <- 2D@d0.end(stream) 4B1@d0.end(job)
4R <- 2R@d0.end(stream) 4B1@d0.end(job) 4D@d0.end(job)""")

    def test_train_first_backward_waits_for_every_output(self):
        p = build_program(*TRAIN_6, "train", 3, 2, "stage")
        i = p.actions[0].index(UploadGrad(3, 0))
        self.assertExpectedInline(deps_text(p, 0, range(i, i + 1)), """\
3G0 <-
    3U0@d0.end(stream)
    0F1@d0.start(issue)
    2O0@d2.end(grad, hop)
    2O1@d2.end(grad, hop)""")


class TestTextFormat(expecttest.TestCase):
    def test_action_strings_round_trip(self):
        actions = [Prefetch(3), Upload(3, 1), UploadGrad(3, 1), Forward(3, 1), FusedBackward(3, 1),
                   RecomputeBackward(3, 1), Offload(3, 1), DownloadGrads(3), Release(3),
                   OptimizerStep(range(4, 6))]
        text = " ".join(map(str, actions))
        self.assertExpectedInline(text, """3P 3U1 3G1 3F1 3FB1 3B1 3O1 3D 3R S4:6""")
        self.assertEqual([parse_action(str(a)) for a in actions], actions)

    @pytest.mark.filterwarnings("ignore")
    def test_program_round_trip(self):
        for G, M, dispatch in itertools.product((1, 2, 3), (1, 4), ("stage", "roundpipe")):
            for plan, run_type in ((FUSED_6, "fused"), (TRAIN_6, "train")):
                p = build_program(*plan, run_type, G, M, dispatch, optimizer=M == 4)
                self.assertEqual(Program.parse(str(p)), p)
                self.assertEqual(str(Program.parse(str(p))), str(p))

    def test_parse_errors(self):
        for bad in ("3Y1", "3P1", "3F", "F3.1", "3X", ""):
            with self.assertRaisesRegex(ValueError, "not an action"):
                parse_action(bad)
        text = str(build_program(*FUSED_6, "fused", 2, 1, "stage"))
        with self.assertRaisesRegex(ValueError, "starts with"):
            Program.parse(text.replace("program", "prog", 1))
        with self.assertRaisesRegex(ValueError, "bad table row"):
            Program.parse(text.replace("\n3 ", "\n4 ", 1))
        with self.assertRaisesRegex(ValueError, "gap"):
            Program.parse(re.sub(r"\n1( +)0U0", r"\n1\1.  ", text, count=1))

    def test_stage_spec_and_relations(self):
        p = build_program([range(0, 2), range(2, 4)], [range(4, 5), range(1, 4), range(0, 1)],
                          "fused", 2, 1, "stage")
        self.assertEqual(p.stages[3], StageSpec(3, "bwd", range(1, 4), ("l0",), ("l3",)))
        self.assertEqual([p.input_of(s) for s in range(5)], [HOST, 0, 1, 0, HOST])
        self.assertEqual([p.grad_of(s) for s in range(5)], [None, None, None, 2, 3])
        self.assertEqual(p.saved_inputs_of(0), [3])
        self.assertEqual(p.run_type, "fused")


def resident_counts(actions) -> list[int]:
    held, counts = set(), []
    for a in actions:
        if isinstance(a, Prefetch):
            held.add(a.stage)
        elif isinstance(a, Release):
            held.discard(a.stage)
        counts.append(len(held))
    return counts


class TestBuilderInvariants(expecttest.TestCase):
    def programs(self):
        for run_type, L in (("fused", 5), ("train", 4), ("infer", 4)):
            for fwd, bwd in plans(L, run_type):
                for G, M in ((1, 2), (2, 3), (3, 1), (4, 5)):
                    for dispatch in ("stage", "roundpipe"):
                        yield build_program(fwd, bwd if run_type != "infer" else [], run_type, G,
                                            M, dispatch), dispatch
                    if run_type == "fused":
                        yield build_program(fwd, bwd, run_type, G, M, round_size=2,
                                            forward_lead=1, split_stages=(len(fwd),)), "lead"

    def test_invariants(self):
        n = 0
        for p, dispatch in self.programs():
            n += 1
            p.validate()   # each (stage, mb) exactly once; dependencies resolve
            G = p.num_devices
            for d, acts in enumerate(p.actions):
                self.assertLessEqual(max(resident_counts(acts), default=0), 2, f"device {d}\n{p}")
                held = set()
                computes = [a for a in acts if isinstance(a, (Forward, FusedBackward,
                                                              RecomputeBackward))]
                last_compute = None
                for a in acts:
                    if isinstance(a, Prefetch):
                        held.add(a.stage)
                        if dispatch == "stage" and last_compute is not None:
                            # rule 2: issued when the previous stage's first compute starts
                            first = next(c for c in computes if c.stage == a.stage - G)
                            self.assertEqual(last_compute, first, f"device {d}\n{p}")
                    elif isinstance(a, Release):
                        held.remove(a.stage)
                    elif isinstance(a, (Forward, FusedBackward, RecomputeBackward)):
                        self.assertIn(a.stage, held, f"{a} before its Prefetch on device {d}")
                        last_compute = a
                        if dispatch == "stage":
                            self.assertEqual(a.stage % G, d)
                if dispatch == "stage":
                    stages = [c.stage for c in computes]
                    self.assertEqual(stages, sorted(stages))
        self.assertGreater(n, 250)

    def test_stage_dispatch_prefetch_follows_first_compute(self):
        p = build_program(*TRAIN_6, "train", 2, 3, "stage")
        acts = p.actions[0]
        i = acts.index(Prefetch(2))
        self.assertEqual(acts[i - 3:i], (Forward(0, 0), Offload(0, 0), Free(0, 0)))
        self.assertEqual(resident_counts(acts)[i], 2)

    def test_roundpipe_rotation_uses_device_free(self):
        calls = []

        def device_free(partial: Program):
            calls.append(partial)
            return [5.0, 1.0, 9.0]

        p = build_program(*FUSED_6, "fused", 3, 4, "roundpipe", device_free=device_free)
        self.assertEqual(len(calls), 1)            # once, before round 2
        first_of_round_2 = [d for d, acts in enumerate(p.actions) if Forward(0, 3) in acts]
        self.assertEqual(first_of_round_2, [1])

    def test_validate_rejects_bad_programs(self):
        p = build_program(*FUSED_6, "fused", 2, 1, "stage")
        acts = [list(a) for a in p.actions]
        no_prefetch = [a for a in acts[0] if a != Prefetch(0)]
        with self.assertRaisesRegex(ValueError, r"device 0 step 1: 0F0 runs stage 0 with no "
                                                r"Prefetch\(0\)"):
            replace(p, actions=(tuple(no_prefetch), tuple(acts[1]))).dependencies()
        twice = acts[0] + [Prefetch(0), Upload(0, 0), Forward(0, 0)]
        with self.assertRaisesRegex(ValueError, "0F0 appears twice"):
            replace(p, actions=(tuple(twice), tuple(acts[1]))).dependencies()
        with self.assertRaisesRegex(ValueError, "stage 0 microbatch 0 runs 2 times"):
            replace(p, actions=(tuple(twice), tuple(acts[1]))).validate()
        missing = [a for a in acts[1] if a != RecomputeBackward(3, 0)]
        with self.assertRaisesRegex(ValueError, "stage 3 microbatch 0 runs 0 times"):
            replace(p, actions=(tuple(acts[0]), tuple(missing))).validate()
        no_upload = [a for a in acts[0] if a != Upload(0, 0)]
        with self.assertRaisesRegex(ValueError, "has no Upload before it"):
            replace(p, actions=(tuple(no_upload), tuple(acts[1]))).dependencies()
        with self.assertRaisesRegex(ValueError, "FusedBackward"):
            bad = [RecomputeBackward(2, 0) if a == FusedBackward(2, 0) else a for a in acts[0]]
            replace(p, actions=(tuple(bad), tuple(acts[1]))).validate()

    def test_builder_argument_errors(self):
        with self.assertRaisesRegex(ValueError, "dispatch"):
            build_program(*FUSED_6, "fused", 2, 2, "zigzag")
        with self.assertRaisesRegex(ValueError, "run_type"):
            build_program(*FUSED_6, "fwd", 2, 2)
        with self.assertRaisesRegex(ValueError, "needs a backward plan"):
            build_program(FUSED_6[0], [], "train", 2, 2)
