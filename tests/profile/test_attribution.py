"""Attribution of a step's time from a Chrome trace: synthetic traces in torch.profiler's format (host
ranges, launch calls with correlation ids, kernels), eager and CUDA-graph steps, and the CPU ranges."""

import pytest

from kiln.profile import attribution as A


def rng(name, ts, dur, cat="user_annotation", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def launch(corr, ts, name="cuLaunchKernel", cat="cuda_driver"):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": ts,
        "dur": 1,
        "tid": 1,
        "pid": 1,
        "args": {"correlation": corr},
    }


def kernel(name, corr, ts, dur, cat="kernel"):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": ts,
        "dur": dur,
        "tid": 7,
        "pid": 0,
        "args": {"correlation": corr},
    }


def eager_trace():
    """One eager step at t=100..200 (host): a memcpy, then layer 0's qkv GEMV and its split-K sum, the
    attention kernels, then the head's GEMM outside any module range, and the device-to-host copy."""
    return [
        rng(A.STEP, 100, 100),
        # the GPU-side projection of the same range must not count as a second step
        rng(A.STEP, 105, 90, cat="gpu_user_annotation", tid=7),
        launch(1, 101, "cudaMemcpyAsync", "cuda_runtime"),
        rng("kiln/model", 102, 60),
        rng("kiln/model.layers.0", 103, 50),
        rng("kiln/model.layers.0.self_attn", 104, 40),
        rng("kiln/model.layers.0.self_attn.qkv_proj", 105, 5),
        launch(2, 106),
        launch(3, 107),
        launch(4, 112),  # rope, in self_attn's own time
        launch(5, 114),  # decode attention split + reduce
        launch(6, 115),
        launch(7, 170, "cudaLaunchKernel", "cuda_runtime"),  # the head, outside the decoder
        launch(8, 175, "cudaMemcpyAsync", "cuda_runtime"),
        kernel("Memcpy HtoD (Pinned -> Device)", 1, 110, 2, cat="gpu_memcpy"),
        kernel("_gemv_kernel", 2, 115, 10),
        kernel("_split_sum_kernel", 3, 126, 2),
        kernel("_rope_kernel", 4, 130, 3),
        kernel("_decode_split_kernel", 5, 135, 8),
        kernel("_decode_reduce_kernel", 6, 144, 2),
        kernel("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT", 7, 172, 12),
        kernel("Memcpy DtoH (Device -> Pinned)", 8, 186, 1, cat="gpu_memcpy"),
        # the next step's work: outside this step's window
        kernel("_gemv_kernel", 99, 260, 10),
    ]


def test_eager_step_rows_name_layers_and_ops_and_sum_to_the_wall():
    ev = eager_trace()
    steps = A.ranges(ev, A.STEP)
    assert len(steps) == 1
    t0, t1 = 100.0, 200.0
    acts = A.gpu_activities(ev, t0, t1)
    assert len(acts) == 8
    A.name_by_launch(ev, acts)
    rows, other = A.gpu_rows(acts, t0, t1)
    got = [(r["layer"], r["op"]) for r in rows]
    assert got == [("io", "memcpy HtoD"), ("layer.0", "qkv_proj"), ("layer.0", "qkv_proj"), ("layer.0", "rope"),
                   ("layer.0", "attention"), ("layer.0", "attention"), ("head", "lm_head"), ("io", "memcpy DtoH")]  # fmt: skip
    o = {r["op"]: r["us"] for r in other}
    assert o["host before first GPU work"] == 10  # 100 -> 110
    # gaps: 112->115 3, 125->126 1, 128->130 2, 133->135 2, 143->144 1, 146->172 26, 184->186 2 = 37
    assert o["idle gaps between GPU work"] == 37
    assert o["host after last GPU work"] == 13  # 187 -> 200
    assert sum(r["us"] for r in rows) + sum(o.values()) == pytest.approx(t1 - t0)


def test_graph_step_is_named_by_alignment_with_the_eager_reference():
    ev = eager_trace()
    ref = [a for a in A.gpu_activities(ev, 100, 200) if a.cat == "kernel"]
    A.name_by_launch(ev, ref)
    # the replay: the same kernels, one launch (correlation 50) for all, no module range around it
    names = [a.name for a in ref]
    graph_ev = [rng(A.STEP, 1000, 80), launch(50, 1001, "cudaGraphLaunch", "cuda_runtime")]
    graph_ev += [kernel(n, 50, 1010 + 6 * i, 5) for i, n in enumerate(names)]
    acts = A.gpu_activities(graph_ev, 1000, 1080)
    info = A.align(acts, ref)
    assert info == {"identical": True, "matched": 6, "step_kernels": 6, "reference_kernels": 6}
    rows, other = A.gpu_rows(acts, 1000, 1080)
    assert [(r["layer"], r["op"]) for r in rows][:3] == [("layer.0", "qkv_proj")] * 2 + [("layer.0", "rope")]
    assert sum(r["us"] for r in rows) + sum(o["us"] for o in other) == pytest.approx(80)


def test_alignment_of_different_kernel_lists_names_the_matching_ones_only():
    ev = eager_trace()
    ref = [a for a in A.gpu_activities(ev, 100, 200) if a.cat == "kernel"]
    A.name_by_launch(ev, ref)
    names = [a.name for a in ref]
    names.insert(3, "some_extra_kernel")  # a kernel the eager run did not launch
    acts = A.gpu_activities([kernel(n, 50, 10 + 6 * i, 5) for i, n in enumerate(names)], 0, 100)
    info = A.align(acts, ref)
    assert not info["identical"] and info["matched"] == 6 and info["step_kernels"] == 7
    rows, _ = A.gpu_rows(acts, 0, 100)
    assert rows[3]["layer"] == "?" and rows[3]["op"].startswith("unattributed")
    assert rows[4]["op"] == "attention"


def test_cpu_rows_are_exclusive_times_that_sum_to_the_step():
    ev = [
        rng(A.STEP, 0, 100),
        rng("kiln/model", 10, 80),
        rng("kiln/model.embed_tokens", 11, 4),
        rng("kiln/model.layers.0", 20, 50),
        rng("kiln/model.layers.0.self_attn", 21, 30),
        rng("kiln/model.layers.0.self_attn.qkv_proj", 22, 10),
        rng("kiln/model.layers.0.mlp", 55, 12),
        rng("kiln/model.norm", 80, 5),
        rng("kiln/model.layers.9", 150, 5),  # another step's range: outside
    ]
    rows, other = A.cpu_rows(ev, A.ranges(ev, A.STEP)[0])
    by = {r["scope"]: r["us"] for r in rows}
    assert by == {"model": 80 - 4 - 50 - 5, "model.embed_tokens": 4, "model.layers.0": 50 - 30 - 12,
                  "model.layers.0.self_attn": 20, "model.layers.0.self_attn.qkv_proj": 10,
                  "model.layers.0.mlp": 12, "model.norm": 5}  # fmt: skip
    assert other[0]["us"] == 20
    assert sum(by.values()) + other[0]["us"] == 100
    ops = {r["scope"]: (r["layer"], r["op"]) for r in rows}
    assert ops["model.layers.0.self_attn.qkv_proj"] == ("layer.0", "qkv_proj")
    assert ops["model.norm"] == ("final", "norm") and ops["model.embed_tokens"] == ("embed", "embed")


def test_scope_layer_op_rules():
    assert A.scope_layer_op("model.layers.3.mlp.down_proj", "_gemv_kernel") == ("layer.3", "down_proj")
    assert A.scope_layer_op("model.layers.3.post_attention_layernorm", "x") == ("layer.3", "norm")
    assert A.scope_layer_op("model.layers.3.mlp", "_swiglu_fwd_kernel") == ("layer.3", "swiglu")
    assert A.scope_layer_op("model.layers.3.self_attn", "_paged_kv_write_kernel") == ("layer.3", "kv_write")
    # the fused q/k/v + RoPE + K/V write kernel runs in the attention's range: it is the q/k/v projection
    assert A.scope_layer_op("model.layers.3.self_attn", "_qkv_rope_kernel") == ("layer.3", "qkv_proj")
    assert A.scope_layer_op("model.layers.3.self_attn", "_rope_kv_write_kernel") == ("layer.3", "rope")
    # and the gate_up matmul with the SwiGLU in its epilogue, launched from the MLP's range
    assert A.scope_layer_op("model.layers.3.mlp", "_gemv_kernel") == ("layer.3", "gate_up_proj")
    assert A.scope_layer_op("model.layers.3.mlp", "_dot_kernel") == ("layer.3", "gate_up_proj")
    assert A.scope_layer_op(None, "void at::native::reduce_kernel<ArgMaxOps>") == ("head", "argmax")
    assert A.scope_layer_op(None, "sm90_xmma_gemm_bf16bf16_bf16f32") == ("head", "lm_head")


def test_decode_attribute_step_picks_the_median_step_and_names_graph_kernels():
    from kiln.profile.decode import attribute_step

    ev = eager_trace()  # its host range becomes the reference run of the captured function
    for e in ev:
        if e["name"] == A.STEP:
            e["name"] = A.REFERENCE
    names = ["_gemv_kernel", "_split_sum_kernel", "_rope_kernel", "_decode_split_kernel",
             "_decode_reduce_kernel", "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT"]  # fmt: skip
    for s, (start, gap, dur) in enumerate([(1000, 1, 60), (2000, 3, 80), (3000, 2, 70)]):
        ev += [rng(A.STEP, start, dur), launch(100 + s, start + 2, "cudaMemcpyAsync", "cuda_runtime"),
               kernel("Memcpy HtoD (Pinned -> Device)", 100 + s, start + 5, 1, cat="gpu_memcpy"),
               launch(200 + s, start + 8, "cudaGraphLaunch", "cuda_runtime")]  # fmt: skip
        ev += [kernel(n, 200 + s, start + 10 + (5 + gap) * i, 5) for i, n in enumerate(names)]
    res = attribute_step(ev, cuda=True, graphs=True)
    assert res["step_walls_us"] == [60.0, 80.0, 70.0] and res["picked"] == 2  # the median wall
    assert res["alignment"]["identical"] and res["alignment"]["matched"] == 6
    rows = res["rows"]
    assert [r["op"] for r in rows] == ["memcpy HtoD", "qkv_proj", "qkv_proj", "rope", "attention", "attention",
                                       "lm_head"]  # fmt: skip
    assert sum(r["us"] for r in rows) + sum(o["us"] for o in res["other"]) == pytest.approx(res["wall_us"])


def test_overlapping_kernels_are_counted_once():
    # b starts 2 us before a ends (programmatic dependent launch) and c lies entirely inside b
    ev = [kernel("a", 1, 10, 10), kernel("b", 2, 18, 10), kernel("c", 3, 20, 3), kernel("d", 4, 30, 5)]
    acts = A.gpu_activities(ev, 0, 40)
    rows, other = A.gpu_rows(acts, 0, 40)
    assert [r["us"] for r in rows] == [10, 8, 0, 5] and [r["dur_us"] for r in rows] == [10, 10, 3, 5]
    o = {r["op"]: r["us"] for r in other}
    assert o == {
        "host before first GPU work": 10,
        "idle gaps between GPU work": 2,
        "host after last GPU work": 5,
    }
    assert sum(r["us"] for r in rows) + sum(o.values()) == 40
