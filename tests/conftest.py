import os
import sys
import tempfile
from pathlib import Path

import pytest

# tiny.py (test model builders) is imported by the test modules as `tiny`.
sys.path.insert(0, str(Path(__file__).parent))

# mx.compile writes into $TMPDIR/mlx: keep it private to the test run.
if "FLASHNORM_TEST_TMP" not in os.environ:
    os.environ["FLASHNORM_TEST_TMP"] = tempfile.mkdtemp(prefix="flashnorm-tests-")
    os.environ["TMPDIR"] = os.environ["FLASHNORM_TEST_TMP"]
    tempfile.tempdir = None
# Each pytest-xdist worker (pyproject's addopts) in its own folder under it: mlx
# writes a compiled kernel's .so where another process may be loading the same.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _worker = Path(os.environ["FLASHNORM_TEST_TMP"], os.environ["PYTEST_XDIST_WORKER"])
    _worker.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(_worker)
    tempfile.tempdir = None


# The suite in parts, each well under 10 minutes even where the whole suite is
# slower (a CUDA build): `pytest -m kernels`, `-m models`, `-m tools`.
PARTS = {
    "kernels": {
        "test_kernels.py",
        "test_dispatch.py",
        "test_nvrtc.py",
        "test_metal_host.py",
        "test_kernel_state.py",
    },
    "models": {
        "test_llama.py",
        "test_dense.py",
        "test_ministral3.py",
        "test_qwen3_5.py",
        "test_lfm2.py",
        "test_glm4_moe.py",
        "test_deepseek_v3.py",
        "test_llama4.py",
        "test_nemotron_h.py",
        "test_granitemoehybrid.py",
        "test_gemma4.py",
        "test_openelm.py",
        "test_qwen.py",
        "test_gemma3.py",
        "test_moe.py",
        "test_gguf.py",
        "test_gguf_kquant.py",
        "test_real_model.py",
        "test_stored.py",
    },
}


# The developer loop, `pytest -m "not slow"`: every test file, the slow tests
# left out. Marked here in one place from measured durations, not in each file:
# file -> test functions (every parametrization), each past SLOW_S of calls
# (`pytest --durations=0` file by file on the shared 2-core CPU, load 10-25,
# 2026-11-27: 2568 s in all; the fast tier 20% of it), a file's cheapest test
# kept where all would go; and the module fixtures whose setup is the cost.
# Three more were slow in the first `-m "not slow"` run (444 s) though under
# SLOW_S file by file (their notes say so). Where a test's work was cut since
# (2026-11-28), its note gives the time it takes now; test_kernels' host-run
# bodies (12-53 s before they ran as fibers) are back in the fast tier.
SLOW_S = 4.0
SLOW = {
    "test_adapters.py": ("test_adapter_matches_mlx_lm_load_with_adapter_path",),  # 12 s
    "test_architectures.py": (
        "test_every_config_float32_matches_stock_over_32_decode_steps",  # 31 s
    ),
    "test_bench.py": (
        "test_cli_engine_and_verbose_table",  # the first mx.compile of a run: 70 s there
        "test_nonorm_finite_with_residuals_scaled",  # 4 s
    ),
    "test_chat.py": ("test_cli_subprocess_piped_stdin_exits_0_on_eof",),  # 16 s
    "test_cli.py": (
        "test_bad_input_gives_one_line_and_nonzero_exit",  # 18 s
        "test_generate_end_to_end",  # 5 s
        "test_generate_runs_every_mode_on_the_engine_asked",  # 47 s
        "test_long_commands_print_stage_lines_when_piped",  # 22 s
        "test_top_k_1_samples_the_greedy_tokens",  # 12 s
    ),
    "test_cli_progress.py": (
        "test_a_fast_convert_prints_its_stages_not_a_line_per_layer",  # 8 s
        "test_ctrl_c_in_a_chat_prefill_drops_the_message_within_1_s",  # 6 s
        "test_ctrl_c_stops_a_requantizing_convert_and_leaves_nothing",  # 2-11 s
        "test_ctrl_c_stops_perplexity_at_once",  # 4-6 s
    ),
    "test_convert.py": ("test_convert_openelm",),  # 6 s
    "test_decoding.py": (
        "test_a_draft_keeps_the_greedy_text",  # 39 s
        "test_chat_with_a_draft_keeps_the_replies",  # 11 s
        "test_kv_options_flashnorm_matches_stock",  # 19 s
        "test_the_embedded_model_drafts_for_its_float32_copy",  # 27 s
    ),
    "test_dispatch.py": (
        "test_flashnorm_launches_fewer_than_nonorm_and_stock",  # 26 s
    ),
    "test_distributed.py": (
        "test_ranks_flashnorm_match_stock_mlx_lm",  # 4 ranks on 2 cores: 30-67 s in the fast run
        "test_a_layout_that_cannot_be_split_is_one_line_from_all_ranks",  # 13 s
        "test_a_rank_that_exits_stops_the_other_with_one_line",  # 9 s
        "test_a_rank_that_fails_loading_is_the_one_line",  # 8 s
        "test_a_rank_that_stops_answering_times_out",  # 11 s
        "test_bench_two_ranks_reports_world_size",  # 23 s
        "test_chat_two_ranks_replies_as_one_process",  # 27 s
        "test_connecting_to_a_rank_that_never_comes_times_out",  # 4 s
        "test_generate_two_ranks_prints_what_one_process_prints",  # 63 s
        "test_ranks_match_one_process",  # 319 s, 48 s since quiet_launch.py
    ),
    "test_engine.py": (
        "test_kernels_survive_compilation",  # 10 s in the fast run
        "test_batched_decode_compiles_block_parts_and_stays_exact",  # 21 s
        "test_compiled_step_gives_the_uncompiled_greedy_text",  # 163 s
        "test_embedded_model_compiled_and_uncompiled_agree_over_32_steps",  # 17 s
        "test_every_variant_on_the_compiled_engine_is_mlx_lm",  # 68 s
        "test_every_variant_traces_one_decode_attention_per_layer",  # 9 s
    ),
    "test_fuzz.py": (
        "test_fuzzed_model_files_never_crash",  # 10 s
        "test_gguf_magic_then_junk_is_one_line_through_the_entry_point",  # 4 s
    ),
    "test_gemma3.py": (
        "test_low_precision_finite_and_close",  # 4 s
        "test_prompt_and_32_cached_steps_across_the_window_match_stock",  # 6 s
        "test_two_rank_tensor_parallel_matches_one_process_and_stock",  # 11 s
        "test_verify_float32_and_quantized_as_stored",  # 25 s
    ),
    "test_gemma4.py": (
        "test_every_tokens_experts_are_stocks_at_every_step",  # 5 s
        "test_two_rank_tensor_parallel_matches_one_process",  # 15 s
    ),
    "test_limits.py": (
        "test_the_loader_and_the_flags_take_the_same_quantization_settings",  # 6 s
    ),
    "test_llama.py": (
        "test_low_precision_close_to_float32_stock",  # 12 s
        "test_no_inf_nan_with_residuals_scaled_by_1000",  # 8 s
    ),
    "test_load_memory.py": ("test_generate_peaks_where_stock_does",),  # 12 s
    "test_mlx_lm_flags.py": ("test_serve_trusts_only_with_the_flag",),  # 6 s
    "test_mlx_lm_habits.py": (
        "test_a_seed_samples_mlx_lms_reply",  # 11 s
        "test_cache_prompt_eos_token_stops_generate_as_mlx_lm",  # 5 s
        "test_cache_prompt_kv_flags_make_mlx_lms_cache",  # 7 s
    ),
    "test_nemotron_h.py": (  # 2026-12-06, -n 0, load 5-8
        "test_verify_float32",  # 8-15 s each: the mixers' first CPU kernel compiles
    ),
    "test_granitemoehybrid.py": (  # 2026-12-06, -n 0, load 1.5-3
        "test_verify_float32",  # 4-16 s each (the MoE config's, eager and compiled)
        "test_two_rank_tensor_parallel_matches_one_process_and_stock",  # 4-27 s
    ),
    "test_openelm.py": ("test_low_precision_no_worse_than_stock",),  # 13 s
    "test_prompt_cache.py": (
        "test_cached_prompt_gives_the_whole_prompt_s_text",  # 4 s
        # mlx-lm's cache_prompt and generate (a process): 10 s
        "test_mlx_lm_s_own_cache_file_continues_as_mlx_lm_s_generate",
    ),
    "test_qwen.py": ("test_low_precision_finite_and_close",),  # 5 s
    "test_real_model.py": (
        "test_verify_dequantized_float32_matches_stock",  # 42 s
        X
    ),
    "test_serve.py": (
        "test_a_long_generation_does_not_starve_a_short_one",  # 5 s
        "test_batched_answers_equal_each_alone_and_report_batch_max",  # 40 s
        "test_chat_answers_paris",  # 13 s
        "test_chat_streams_the_same_answer_ending_done",  # 7 s
        "test_completions_endpoint_and_seed",  # 9 s
        "test_concurrent_requests_are_all_answered",  # 25 s
        "test_next_turn_reuses_the_conversation_cache",  # 9 s
        "test_stock_mode_serves_the_same_function_and_sigterm_stops_it",  # 14 s
    ),
    "test_serve_agents.py": (  # 2026-11-28, 2 xdist workers, load 1-3
        "test_messages_create_and_stream_give_chat_completions_greedy_text",  # 16 s
        "test_responses_create_streamed_and_not_give_chat_completions_greedy_text",  # 11 s
    ),
    "test_serve_batch.py": ("test_batched_greedy_equals_each_request_alone",),  # 10 s
    "test_serve_decoding.py": (
        "test_a_draft_serves_the_greedy_text_one_request_at_a_time",  # 12 s
    ),
    "test_serve_thinking.py": (  # 2026-12-06, -n 0, shared 2 cores
        # mlx_lm.server started for it: 6 s under load, 1.7 s on a quiet CPU
        "test_thought_splits_as_mlx_lm_server_plain_and_streamed",
    ),
    "test_serve_flags.py": (
        "test_info_logs_each_request_and_keeps_its_cache",  # 5 s
        "test_warning_keeps_only_what_is_wrong",  # 6 s
    ),
    "test_serve_guard.py": (
        "test_api_keys_and_cache_salts_share_no_cached_prefixes",  # 14 s
        # 2026-12-06, -n 0, shared 2 cores: 12 requests on three APIs
        "test_a_salted_secret_is_found_by_no_unsalted_client_on_any_route",  # 38 s
    ),
    "test_serve_compare.py": (  # a server of its own: 6 s
        "test_compare_is_refused_beside_a_stream_and_stops_when_its_client_leaves",
    ),
    "test_serve_tools.py": (
        # a second server: 4.4 s under load, 1.2 s on a quiet CPU
        "test_a_template_given_on_the_command_line_brings_its_tool_parser",
    ),
    "test_serve_page.py": (
        "test_page_streams_the_greedy_reply_and_keeps_it",  # 15 s
        "test_stop_ends_a_long_reply_and_the_server_cancels",  # 5 s
    ),
    "test_serve_page_chat.py": (  # a model server and a browser, replies on 2 cores
        "test_speed_moves_while_streaming_and_cached_tokens_show_apart",
        "test_markdown_renders_and_model_text_never_runs",
        "test_a_real_reply_s_list_renders_as_a_list",
        "test_conversations_regenerate_and_edit",
        "test_compare_shows_both_speeds_and_their_ratio",
        "test_phone_header_one_line_no_overflow_and_favicon",
    ),
    # Measured file alone, fresh TMPDIR, on the shared box at load 5 (2026-12-06):
    # the first compiled step pays MLX's kernel compiles (13 s warm of the rest).
    "test_glm4_moe.py": (
        "test_verify_float32_on_the_compiled_engine",  # 13-55 s
        "test_64_greedy_tokens_identical_to_stock_on_both_engines",  # 8 s (q4)
        "test_two_rank_tensor_parallel_matches_one_process_and_stock",  # 8-10 s
        "test_convert_q_rtn_and_gptq_load_in_mlx_lm",  # 2-5 s
    ),
    # File alone, --durations=0, fresh TMPDIR, shared box at load 4-5 (2026-12-06).
    "test_deepseek_v3.py": (
        # Whichever compiled test runs first pays MLX's compiles: 18-38 s fresh,
        # 2 s warm; the 2-rank launch 37 s fresh, 2.5 s warm.
        "test_verify_float32_on_the_compiled_engine",
        "test_64_greedy_tokens_identical_to_stock_on_both_engines",  # 8-18 s
        "test_two_rank_tensor_parallel_matches_one_process_and_stock",
        "test_convert_q_rtn_and_gptq_load_in_mlx_lm",  # 1-4 s
    ),
    # File alone, --durations=0, shared box under load (2026-12-06).
    "test_llama4.py": (
        "test_verify_float32",  # compiled 11-42 s (MLX's compiles), eager 1-4 s
        "test_two_rank_tensor_parallel_matches_one_process",  # 2-11 s
        "test_moe_verify_float32",  # compiled 7-9 s
        "test_moe_two_rank_tensor_parallel_matches_one_process",  # 3-6 s
    ),
    "test_stored.py": (
        "test_float32_matches_stock_on_the_same_quantized_files",  # 37 s
        "test_low_precision_close_to_float32_stock",  # 10 s
    ),
    "test_templates.py": (
        "test_serve_chat_template_kwargs_per_request",  # 5 s
        "test_serve_template_flags_and_adapter",  # 9 s
        "test_template_flags_give_mlx_lm_s_text",  # 11 s
    ),
}
SLOW_FIXTURES = {
    "test_bench.py": ("result",),  # a whole bench run: 47 s
    "test_metal_host.py": ("metal_host",),  # every Metal variant built: 8 s
    "test_nvrtc.py": ("compiled",),  # every CUDA variant compiled: 16 s
    "test_serve_text.py": ("server",),  # a server on the embedded model: 52 s
}


# Tests that start mlx.launch ranks, which spin while they wait for each other:
# one launch at a time (one pytest-xdist group), else two launches' ranks take
# turns on the 2 cores. A file name: all its tests.
LAUNCHES = {
    "test_distributed.py",
    "test_dense.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_ministral3.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_qwen3_5.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_lfm2.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_glm4_moe.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_deepseek_v3.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_nemotron_h.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_granitemoehybrid.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_gemma3.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_gemma4.py::test_two_rank_tensor_parallel_matches_one_process",
    "test_llama4.py::test_two_rank_tensor_parallel_matches_one_process",
    "test_llama4.py::test_moe_two_rank_tensor_parallel_matches_one_process",
    "test_moe.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
}
# Seconds per file in a whole-suite run (pytest-xdist sends the heaviest first).
FILE_S = {  # summed --durations=0, 2 workers, quiet, fresh clone, 2026-11-28
    "test_serve_agents.py": 126,
    "test_distributed.py": 125,
    "test_engine.py": 99,
    "test_serve_text.py": 52,
    "test_serve_page_chat.py": 48,
    "test_serve.py": 45,
    "test_moe.py": 41,
    "test_glm4_moe.py": 60,  # file alone, fresh TMPDIR, load 4-5, 2026-12-06
    "test_deepseek_v3.py": 130,  # file alone, fresh TMPDIR (46 s warm), 2026-12-06
    "test_decoding.py": 31,
    "test_serve_guard.py": 29,
    "test_serve_load.py": 26,
    "test_real_model.py": 64,  # + the seeded mlx-lm test (38 s), 2026-12-06
    "test_gemma3.py": 21,
    "test_cli.py": 20,
    "test_structured.py": 19,
    "test_cli_progress.py": 16,
    "test_serve_page.py": 15,
    "test_nvrtc.py": 13,
    "test_load_memory.py": 13,
}


def is_slow(file: str, test: str, fixtures) -> bool:
    return test in SLOW.get(file, ()) or bool(
        set(SLOW_FIXTURES.get(file, ())) & set(fixtures)
    )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, 4 at most (each holds its models and, on a
    GPU, its own device context); on one core none (tests run in this process)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    n = min(n or os.cpu_count() or 1, 4)
    return n if n > 1 else 0


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile (a file's tests on one worker, its module fixtures built
    once), and every test in LAUNCHES in one more group."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileAndLaunches(LoadFileScheduling):
        def _split_scope(self, nodeid):
            file, _, test = nodeid.partition("::")
            name = Path(file).name
            if {name, f"{name}::{test.split('[')[0]}"} & LAUNCHES:
                return "mlx.launch"
            return super()._split_scope(nodeid)

    return LoadFileAndLaunches(config, log)


def pytest_collection_modifyitems(items):
    for item in items:
        name = item.path.name
        part = next((p for p, files in PARTS.items() if name in files), "tools")
        item.add_marker(getattr(pytest.mark, part))
        test = getattr(item, "originalname", item.name)
        if is_slow(name, test, getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the heaviest files sent first
        items.sort(key=lambda item: -FILE_S.get(item.path.name, 0))
