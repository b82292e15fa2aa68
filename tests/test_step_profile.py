"""benchmarks/step_profile.py's reading of Nsight Compute's CSV (the GPU run itself needs ncu)."""

from benchmarks.step_profile import kernel_family, summarize_ncu

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def row(kid, name, metric, value):
    return (f'"{kid}","1","python3","host","{name}","1","14","(256, 1, 1)","(1, 16, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","","{value}"')


def test_kernel_families_drop_template_suffixes_and_arguments():
    assert kernel_family("mlx::custom_kernel_dsv4_hc_project_bfloat16_t_4_5120_16_1280") == "dsv4_hc_project"
    assert kernel_family("mlx::custom_kernel_dsv4_router_topk_384_6_t") == "dsv4_router_topk"
    assert kernel_family("void mlx::gemv_single<float, 8, 4>(const T1 *, int)") == "mlx::gemv_single<float, 8, 4>"


def test_summary_sums_launches_time_and_bytes_per_family():
    gemv = "void mlx::gemv_single<float, 8, 4>(const T1 *, unsigned int *)"
    proj = "mlx::custom_kernel_dsv4_hc_project_bfloat16_t_4_5120_16_1280(const float *)"
    text = "\n".join(["==PROF== Connected to process 1", HEADER,
                      row(1, gemv, "gpu__time_duration.sum", "12,064"), row(1, gemv, "dram__bytes_read.sum", "7,891,712"),
                      row(2, proj, "gpu__time_duration.sum", "11,744"), row(2, proj, "dram__bytes_read.sum", "2,018,304"),
                      row(3, gemv, "gpu__time_duration.sum", "577,184"), row(3, gemv, "dram__bytes_read.sum", "2,648,052,480")])
    rows = summarize_ncu(text)
    assert [r[0] for r in rows] == ["mlx::gemv_single<float, 8, 4>", "dsv4_hc_project"]   # by time
    name, launches, us, read = rows[0]
    assert launches == 2 and abs(us - (12.064 + 577.184)) < 1e-9 and read == 7_891_712 + 2_648_052_480
    assert rows[1][1:] == (1, 11.744, 2_018_304)


def test_summary_of_output_without_a_table_is_empty():
    assert summarize_ncu("==PROF== no kernels were profiled") == []


def test_the_profiled_propose_drafts_what_the_reference_propose_drafts():
    """--propose K times FixedDraft.propose over the window a prefill seeded: its drafts are those
    of the op-by-op propose from the same window (the toy-width slice, greedy)."""
    import mlx.core as mx
    import numpy as np

    from benchmarks.slice_decode import ROLES, SMALL, build
    from benchmarks.speculative_steps import DRAFT_SMALL, proposal_arrays, with_draft
    from benchmarks.step_profile import proposer_after_prefill
    from dsv4.generation import prefill
    from dsv4.sampling import LogitAdjustment, Sampling
    from dsv4.speculative import propose

    config = {**SMALL, **ROLES}
    model, _, _ = build(config)
    with_draft(model, {**config, **DRAFT_SMALL})
    fixed, make = proposer_after_prefill(model, 48)
    got = proposal_arrays(make(3))[0]
    fixed.close()
    ids = np.random.default_rng(48).integers(7, model.args.vocab_size, (1, 48))
    cache, window = model.make_cache(), model.draft.make_cache()
    token = int(mx.argmax(prefill(model, ids, cache, draft_cache=window), axis=-1).item())
    greedy = Sampling()
    want = propose(model, window, token, 3, LogitAdjustment(greedy, model.args.vocab_size), greedy).drafts
    assert got.shape == (3,) and np.array_equal(np.array(got), np.array(want))
