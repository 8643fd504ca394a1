"""SGLang 0.5.23's ServerArgs fields, pinned, and the check of ``rollout.engine_kwargs.sglang`` against them.

In 0.5.23 ``ServerArgs`` (srt/server_args.py) is assembled from the namespaces in srt/arg_groups/fields/*.py.
The lists below were read from the sglang-0.5.23 cp311 wheel with ``ast`` (nothing imported): every annotated
field of those classes, grouped by its declared type (``A[T, ...]``: T; ``Optional[T]`` also in
OPTIONAL_FIELDS), and CHOICES the closed value sets (``Literal[...]`` or ``Arg(choices=...)``, lists from
srt/arg_groups/choices.py; fields whose choices are computed at run time have none here).
tests/rollout/test_sglang_contract.py compares them with the wheel. sglang itself is never imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_rl.config.errors import ConfigError
from megatron_rl.rollout.engine_args import name_problem

__all__ = ["CHOICES", "OWNED_SERVER_ARGS", "SERVER_ARG_NAMES", "check_engine_kwargs"]

ROLLOUT = "actor_rollout_ref.rollout"

BOOL_FIELDS = frozenset({
    '_radix_eviction_policy_explicitly_set', '_speculative_draft_quantization_explicitly_set',
    '_swa_full_tokens_ratio_explicitly_set', 'abort_on_priority_when_disabled', 'allow_auto_truncate',
    'checkpoint_engine_wait_weights_before_ready', 'constrained_json_disable_any_whitespace', 'dcp_replicate_q_proj',
    'debug_cuda_graph', 'delete_ckpt_after_loading', 'disable_aiter_allreduce_fusion_in_decode',
    'disable_aiter_allreduce_fusion_in_prefill', 'disable_attn_tp_gather', 'disable_chunked_prefix_cache',
    'disable_cuda_graph', 'disable_cuda_graph_padding', 'disable_custom_all_reduce', 'disable_decode_cuda_graph',
    'disable_fast_image_processor', 'disable_flashinfer_autotune', 'disable_flashinfer_cutlass_moe_fp4_allgather',
    'disable_hybrid_swa_memory', 'disable_outlines_disk_cache', 'disable_overlap_schedule',
    'disable_prefill_cuda_graph', 'disable_priority_preemption', 'disable_radix_cache',
    'disable_shared_experts_fusion', 'disable_tokenizer_batch_decode', 'disaggregation_decode_enable_offload_kvcache',
    'disaggregation_decode_enable_radix_cache', 'disaggregation_enable_kv_checksum', 'dllm_fdfo',
    'enable_adaptive_dispatch_to_encoder', 'enable_aiter_allreduce_fusion', 'enable_amd_monokernel',
    'enable_attn_tp_input_scattered', 'enable_broadcast_mm_inputs_process', 'enable_cache_report',
    'enable_cp_decode_attn_tp', 'enable_cp_tp_group_sharing', 'enable_cudagraph_gc', 'enable_custom_logit_processor',
    'enable_decoder_swa_bounded_replay', 'enable_deepseek_v4_fp4_indexer', 'enable_dense_mlp_attn_tp',
    'enable_deterministic_inference', 'enable_dp_attention', 'enable_dp_attention_local_control_broadcast',
    'enable_dp_lm_head', 'enable_draft_weights_cpu_backup', 'enable_dsa_cache_layer_split',
    'enable_dsa_fused_indexer', 'enable_dynamic_batch_tokenizer', 'enable_dynamic_chunking',
    'enable_elastic_expert_backup', 'enable_encoder_swa_bounded_replay', 'enable_eplb',
    'enable_flashinfer_allreduce_fusion', 'enable_flexkv', 'enable_forward_pass_metrics', 'enable_fp32_lm_head',
    'enable_fused_moe_sum_all_reduce', 'enable_fused_qk_norm_rope', 'enable_hierarchical_cache', 'enable_hisparse',
    'enable_http2', 'enable_http_worker_reuseport', 'enable_int8_mamba_checkpoint', 'enable_kv_cache_sharding',
    'enable_layernorm_sp', 'enable_layerwise_nvtx_marker', 'enable_lean_attention', 'enable_linear_replayssm',
    'enable_linear_replayssm_spec', 'enable_linker_mla_dedup', 'enable_lmcache', 'enable_lora',
    'enable_lora_overlap_loading', 'enable_mamba_cache_stochastic_rounding', 'enable_megamoe_for_layernorm_sp',
    'enable_memory_saver', 'enable_metrics', 'enable_metrics_for_all_schedulers', 'enable_mfu_metrics', 'enable_mis',
    'enable_mixed_chunk', 'enable_mm_global_cache', 'enable_mscclpp', 'enable_multi_layer_eagle', 'enable_multimodal',
    'enable_nccl_nvls', 'enable_nvidia_megakernel', 'enable_p2p_check', 'enable_page_major_kv_layout',
    'enable_paged_experts', 'enable_pd_role_switch', 'enable_pdmux', 'enable_precise_embedding_interpolation',
    'enable_prefill_cp', 'enable_prefill_delayer', 'enable_prefix_mm_cache', 'enable_priority_scheduling',
    'enable_profile_cuda_graph', 'enable_quant_communications', 'enable_request_time_stats_logging',
    'enable_response_store', 'enable_return_aux_hidden_states', 'enable_return_hidden_states',
    'enable_return_indexer_topk', 'enable_return_routed_experts', 'enable_scattered_sconv',
    'enable_session_radix_cache', 'enable_shared_experts_attn_tp', 'enable_single_batch_overlap',
    'enable_ssl_refresh', 'enable_streaming_session', 'enable_strict_thinking', 'enable_symm_mem',
    'enable_tf32_matmul', 'enable_tokenizer_batch_encode', 'enable_torch_compile', 'enable_torch_compile_debug_mode',
    'enable_torch_symm_mem', 'enable_tp_lm_head_all_to_all', 'enable_trace', 'enable_two_batch_overlap',
    'enable_unified_cache_external_linker', 'enable_unified_memory', 'enable_w4a4_mxfp4_megamoe', 'enable_waterfill',
    'enable_watermark', 'enable_weights_cpu_backup', 'encoder_only', 'enforce_disable_flashinfer_allreduce_fusion',
    'enforce_shared_experts_fusion', 'experts_shared_outer_loras', 'export_metrics_to_file',
    'flashinfer_mla_disable_ragged', 'grpc_mode', 'incremental_streaming_output', 'is_embedding',
    'language_model_only', 'language_only', 'log_requests', 'lora_strict_loading', 'lora_use_virtual_experts',
    'mlx_enable_sampling', 'mm_enable_dp_encoder', 'ple_offload_embedding', 'pre_warm_nccl',
    'prefill_only_disable_kv_cache', 'quantize_and_serve',
    'remote_instance_weight_loader_start_seed_via_transfer_engine', 'return_input_ids', 'return_output_ids',
    'schedule_low_priority_values_first', 'show_time_cost', 'skip_server_warmup', 'skip_tokenizer_init',
    'sleep_on_idle', 'smg_grpc_mode', 'speculative_adaptive', 'speculative_dspark_align_verify_tokens_to_graph_tier',
    'speculative_enable_w4a4_mxfp4_megamoe', 'speculative_use_block_verification',
    'speculative_use_rejection_sampling', 'stream_response_default_include_usage', 'strip_thinking_cache',
    'triton_attention_reduce_in_fp32', 'trust_mm_content_hashes', 'trust_remote_code', 'trust_request_chat_template',
    'use_ray', 'uses_mamba_radix_cache', 'watermark_default_enabled', 'watermark_enforce_all',
    'weight_loader_disable_mmap', 'weight_loader_drop_cache_after_load', 'weight_loader_prefetch_checkpoints'
})

INT_FIELDS = frozenset({
    'asr_max_buffer_seconds', 'asr_max_concurrent_sessions', 'attn_cp_size', 'attn_dp_size', 'base_gpu_id',
    'batch_notify_size', 'c128_page_size', 'chunked_prefill_size', 'constrained_json_max_whitespace_cnt',
    'context_length', 'cpu_offload_gb', 'cuda_graph_max_bs_decode', 'cuda_graph_max_bs_prefill',
    'cuda_graph_max_seq_len_prefill', 'cuda_graph_prefill_max_context', 'dcp_size', 'decode_log_interval',
    'decoupled_spec_rank', 'default_priority_value', 'detokenizer_worker_num', 'disaggregation_bootstrap_port',
    'disaggregation_decode_extra_slots', 'disaggregation_decode_polling_interval', 'dist_timeout', 'dp_size',
    'dsa_triton_union', 'dwdp_size', 'dynamic_batch_tokenizer_batch_size', 'elastic_ep_initial_size',
    'encoder_bootstrap_port', 'engine_info_bootstrap_port', 'ep_join_rank_offset', 'ep_num_redundant_experts',
    'ep_size', 'eplb_rebalance_layers_per_chunk', 'eplb_rebalance_num_iterations',
    'expert_distribution_recorder_buffer_size', 'gated_launch_port', 'gpu_id_step', 'grpc_port',
    'grpc_response_timeout_secs', 'grpc_worker_threads', 'hicache_size',
    'hicache_storage_prefetch_retry_max_attempts', 'hicache_storage_prefetch_retry_poll_interval',
    'http2_initial_connection_window_size', 'http2_max_concurrent_streams', 'int8_mamba_ckpt_size', 'kt_cpuinfer',
    'kt_max_deferred_experts_per_token', 'kt_num_gpu_experts', 'kt_threadpool_count', 'kv_canary_sweep_interval',
    'linear_replayssm_cache_len', 'load_snapshot_publish_interval', 'log_requests_level', 'mamba_cache_philox_rounds',
    'mamba_max_states_per_path', 'mamba_track_interval', 'max_ep_size', 'max_loaded_loras', 'max_lora_chunk_size',
    'max_lora_rank', 'max_loras_per_batch', 'max_mamba_cache_size', 'max_prefill_tokens', 'max_queued_requests',
    'max_running_requests', 'max_total_tokens', 'media_url_max_file_size_mb', 'min_free_slots_delay',
    'mm_io_worker_num', 'mm_preprocess_cache_size_mb', 'mm_processor_worker_num', 'moe_dense_tp_size', 'moe_dp_size',
    'nccl_port', 'nnodes', 'node_rank', 'num_continuous_decode_steps', 'num_reserved_decode_tokens',
    'offload_group_size', 'offload_num_in_group', 'offload_prefetch_step', 'optimistic_prefill_attempts', 'page_size',
    'paged_experts_num_resident', 'port', 'pp_async_batch_depth', 'pp_max_micro_batch_size', 'pp_size',
    'prefill_decode_interval', 'prefill_decode_interval_min_bs', 'prefill_delayer_max_delay_passes',
    'prefill_max_requests', 'priority_scheduling_preemption_threshold', 'random_seed',
    'remote_instance_weight_loader_seed_instance_service_port', 'sampling_mask_max_tokens', 'scheduler_recv_interval',
    'shared_experts_tp_size', 'sm_group_num', 'smg_http_sidecar_port', 'speculative_dflash_block_size',
    'speculative_domino_candidate_pool_size', 'speculative_draft_sink_size', 'speculative_draft_window_size',
    'speculative_dspark_block_size', 'speculative_eagle_topk', 'speculative_ngram_capacity',
    'speculative_ngram_external_corpus_max_tokens', 'speculative_ngram_external_sam_budget',
    'speculative_ngram_max_bfs_breadth', 'speculative_ngram_max_trie_depth', 'speculative_ngram_min_bfs_breadth',
    'speculative_num_draft_tokens', 'speculative_num_steps', 'stream_interval', 'swa_prefix_tails',
    'tokenizer_worker_num', 'torch_compile_max_bs', 'tp_size', 'triton_attention_num_kv_splits',
    'triton_attention_split_tile_size', 'watermark_context_window', 'weight_cache_timeout',
    'weight_loader_prefetch_num_threads'
})

FLOAT_FIELDS = frozenset({
    'disaggregation_decode_host_receive_threshold', 'dynamic_batch_tokenizer_batch_timeout',
    'elastic_ep_scale_timeout', 'eplb_min_rebalancing_utilization_threshold', 'gc_warning_threshold_secs',
    'hicache_host_memory_fraction', 'hicache_ratio', 'lora_drain_wait_threshold', 'mamba_full_memory_ratio',
    'mem_fraction_static', 'prefill_delayer_max_delay_ms', 'prefill_delayer_queue_min_ratio',
    'prefill_delayer_token_usage_low_watermark', 'schedule_conservativeness', 'soft_watchdog_timeout',
    'speculative_accept_threshold_acc', 'speculative_accept_threshold_single', 'swa_full_tokens_ratio',
    'tbo_token_distribution_threshold', 'watchdog_timeout', 'watermark_max_probability',
    'watermark_mixing_probability'
})

STR_FIELDS = frozenset({
    'admin_api_key', 'api_key', 'attention_backend', 'aux_hidden_state_capture', 'bf16_gemm_backend',
    'boundary_reduction', 'chat_template', 'completion_template', 'constrained_json_whitespace_pattern',
    'cp_strategy', 'crash_dump_folder', 'cuda_graph_backend_decode', 'cuda_graph_backend_prefill', 'dcp_comm_backend',
    'debug_tensor_dump_input_file', 'debug_tensor_dump_output_folder', 'decode_attention_backend',
    'decoupled_spec_bind_endpoint', 'decoupled_spec_role', 'decrypted_config_file', 'decrypted_draft_config_file',
    'deepep_config', 'deepep_dispatcher_output_dtype', 'deepep_mode', 'deepep_v2_mode', 'device',
    'disaggregation_decode_allocation_policy', 'disaggregation_decode_retraction_backup', 'disaggregation_ib_device',
    'disaggregation_mode', 'disaggregation_transfer_backend', 'dist_init_addr', 'dllm_algorithm',
    'dllm_algorithm_config', 'download_dir', 'dsa_decode_backend', 'dsa_paged_mqa_logits_backend',
    'dsa_prefill_backend', 'dsa_topk_backend', 'dsv4_attn_backend', 'dsv4_prefill_backend', 'dtype',
    'encoder_transfer_backend', 'ep_dispatch_algorithm', 'ep_join_mode', 'eplb_algorithm',
    'expert_balancedness_report_mode', 'expert_distribution_recorder_mode', 'export_metrics_to_file_dir',
    'fastapi_root_path', 'file_storage_path', 'flashinfer_a2a_dispatch_type', 'flashinfer_allreduce_fusion_backend',
    'flashinfer_mxfp4_moe_precision', 'flexkv_config_file', 'forward_pass_metrics_ipc_name',
    'forward_pass_metrics_worker_id', 'fp4_gemm_runner_backend', 'fp8_gemm_runner_backend', 'grammar_backend',
    'hf_chat_template_name', 'hicache_host_memory_mode', 'hicache_io_backend', 'hicache_mem_layout',
    'hicache_storage_backend', 'hicache_storage_backend_extra_config', 'hicache_storage_prefetch_policy',
    'hicache_write_policy', 'hisparse_config', 'host', 'image_processor_backend', 'init_expert_location',
    'json_model_override_args', 'kt_method', 'kt_weight_path', 'kv_cache_dtype', 'kv_canary', 'kv_canary_real_data',
    'kv_events_config', 'linear_attn_backend', 'linear_attn_decode_backend', 'linear_attn_prefill_backend',
    'linear_attn_verify_backend', 'lmcache_config_file', 'load_balance_method', 'load_format',
    'load_publish_endpoint', 'log_level', 'log_level_http', 'log_requests_format', 'lora_backend',
    'lora_eviction_policy', 'mamba_backend', 'mamba_radix_cache_strategy', 'mamba_ssm_dtype', 'mm_attention_backend',
    'mm_feature_transport', 'mm_global_cache_backend', 'model_checksum', 'model_config_parser', 'model_impl',
    'model_loader_extra_config', 'model_path', 'modelexpress_config', 'modelopt_checkpoint_restore_path',
    'modelopt_checkpoint_save_path', 'modelopt_export_path', 'moe_a2a_backend', 'moe_runner_backend',
    'mooncake_ib_device', 'msprobe_dump_config', 'offload_mode', 'otlp_service_name', 'otlp_traces_endpoint',
    'pdmux_config_path', 'ple_offload_backend', 'ple_offload_dir', 'preferred_sampling_params',
    'prefill_attention_backend', 'prefill_kv_cache_dequant_dtype', 'qsa_indexer_dtype', 'quantization',
    'quantization_param_path', 'radix_cache_backend', 'radix_eviction_policy', 'reasoning_parser',
    'remote_instance_weight_loader_backend', 'remote_instance_weight_loader_seed_instance_ip', 'retraction_policy',
    'return_hidden_states_mode', 'revision', 'rl_on_policy_target', 'rl_quant_profile', 'sampling_backend',
    'sampling_defaults', 'schedule_policy', 'served_model_name', 'sidecar', 'spec_trace_dir',
    'speculative_adaptive_config', 'speculative_algorithm', 'speculative_attention_mode',
    'speculative_boundary_reduction', 'speculative_draft_attention_backend', 'speculative_draft_kv_cache_dtype',
    'speculative_draft_load_format', 'speculative_draft_model_path', 'speculative_draft_model_quantization',
    'speculative_draft_model_revision', 'speculative_dsa_topk_backend', 'speculative_dspark_confidence_sts_path',
    'speculative_dspark_sps_table_path', 'speculative_moe_a2a_backend', 'speculative_moe_runner_backend',
    'speculative_ngram_external_corpus_path', 'speculative_ngram_match_type', 'speculative_token_map', 'ssl_ca_certs',
    'ssl_certfile', 'ssl_keyfile', 'ssl_keyfile_password', 'startup_weight_load_mode', 'tokenizer_backend',
    'tokenizer_metrics_custom_labels_header', 'tokenizer_mode', 'tokenizer_path', 'tool_call_parser', 'tool_server',
    'trace_modules', 'unified_cache_external_linker_backend', 'uno_lora_path', 'warmups', 'watermark_config',
    'watermark_key', 'watermark_key_b', 'weight_cache_mode', 'weight_cache_socket', 'weight_version'
})

OTHER_FIELDS = frozenset({
    'allowed_media_domains', 'bucket_e2e_request_latency', 'bucket_inter_token_latency', 'bucket_time_to_first_token',
    'cuda_graph_bs_decode', 'cuda_graph_bs_prefill', 'cuda_graph_config', 'custom_sigquit_handler',
    'custom_weight_loader', 'debug_tensor_dump_layers', 'decoupled_spec_connect_endpoints',
    'default_chat_template_kwargs', 'elastic_ep_backend', 'encoder_register_urls', 'encoder_urls',
    'extra_metric_labels', 'flashinfer_autotune_skip_ops', 'forward_hooks', 'fuseep_mode', 'gc_threshold',
    'generation_tokens_buckets', 'limit_mm_data_per_request', 'log_requests_target', 'lora_paths',
    'lora_target_modules', 'mm_process_config', 'modelopt_quant', 'numa_node',
    'prefill_delayer_forward_passes_buckets', 'prefill_delayer_wait_seconds_buckets', 'prompt_tokens_buckets',
    'radix_eviction_policy_config', 'remote_instance_weight_loader_send_weights_group_ports',
    'return_aux_hidden_state_layer_ids', 'sidecar_args', 'stat_loggers', 'tokenizer_metrics_allowed_custom_labels',
    'unified_cache_external_linker_config', 'uvicorn_access_log_exclude_prefixes'
})

OPTIONAL_FIELDS = frozenset({
    '_speculative_draft_quantization_explicitly_set', '_swa_full_tokens_ratio_explicitly_set', 'admin_api_key',
    'api_key', 'attention_backend', 'aux_hidden_state_capture', 'bucket_e2e_request_latency',
    'bucket_inter_token_latency', 'bucket_time_to_first_token', 'chat_template', 'chunked_prefill_size',
    'completion_template', 'constrained_json_max_whitespace_cnt', 'constrained_json_whitespace_pattern',
    'context_length', 'cp_strategy', 'crash_dump_folder', 'cuda_graph_backend_decode', 'cuda_graph_backend_prefill',
    'cuda_graph_bs_decode', 'cuda_graph_bs_prefill', 'cuda_graph_config', 'cuda_graph_max_bs_decode',
    'cuda_graph_max_bs_prefill', 'cuda_graph_max_seq_len_prefill', 'cuda_graph_prefill_max_context',
    'custom_sigquit_handler', 'custom_weight_loader', 'dcp_comm_backend', 'dcp_replicate_q_proj',
    'debug_tensor_dump_input_file', 'debug_tensor_dump_layers', 'debug_tensor_dump_output_folder',
    'decode_attention_backend', 'decoupled_spec_bind_endpoint', 'decoupled_spec_connect_endpoints',
    'decoupled_spec_rank', 'decrypted_config_file', 'decrypted_draft_config_file', 'deepep_config',
    'default_chat_template_kwargs', 'default_priority_value', 'device', 'disaggregation_decode_extra_slots',
    'disaggregation_decode_retraction_backup', 'disaggregation_ib_device', 'dist_init_addr', 'dist_timeout',
    'dllm_algorithm', 'dllm_algorithm_config', 'download_dir', 'dsa_decode_backend', 'dsa_prefill_backend',
    'elastic_ep_initial_size', 'enable_decoder_swa_bounded_replay', 'enable_dsa_fused_indexer',
    'enable_fused_qk_norm_rope', 'enable_lean_attention', 'enable_lora', 'enable_lora_overlap_loading',
    'enable_multimodal', 'enable_quant_communications', 'enable_tf32_matmul', 'enable_tp_lm_head_all_to_all',
    'ep_dispatch_algorithm', 'ep_join_mode', 'eplb_rebalance_layers_per_chunk',
    'expert_distribution_recorder_buffer_size', 'expert_distribution_recorder_mode', 'experts_shared_outer_loras',
    'export_metrics_to_file_dir', 'extra_metric_labels', 'file_storage_path', 'flashinfer_a2a_dispatch_type',
    'flashinfer_allreduce_fusion_backend', 'flashinfer_autotune_skip_ops', 'flexkv_config_file', 'forward_hooks',
    'forward_pass_metrics_ipc_name', 'gated_launch_port', 'gc_threshold', 'generation_tokens_buckets',
    'grammar_backend', 'grpc_port', 'grpc_worker_threads', 'hf_chat_template_name', 'hicache_host_memory_fraction',
    'hicache_ratio', 'hicache_storage_backend', 'hicache_storage_backend_extra_config', 'hisparse_config',
    'int8_mamba_ckpt_size', 'kt_cpuinfer', 'kt_max_deferred_experts_per_token', 'kt_num_gpu_experts',
    'kt_weight_path', 'kv_events_config', 'limit_mm_data_per_request', 'linear_attn_decode_backend',
    'linear_attn_prefill_backend', 'linear_attn_verify_backend', 'lmcache_config_file', 'load_publish_endpoint',
    'log_level_http', 'log_requests_target', 'lora_paths', 'lora_target_modules', 'mamba_full_memory_ratio',
    'mamba_ssm_dtype', 'max_ep_size', 'max_loaded_loras', 'max_lora_chunk_size', 'max_lora_rank',
    'max_mamba_cache_size', 'max_queued_requests', 'max_running_requests', 'max_total_tokens', 'mem_fraction_static',
    'min_free_slots_delay', 'mm_attention_backend', 'mm_enable_dp_encoder', 'mm_feature_transport',
    'mm_preprocess_cache_size_mb', 'mm_process_config', 'model_checksum', 'modelexpress_config',
    'modelopt_checkpoint_restore_path', 'modelopt_checkpoint_save_path', 'modelopt_export_path', 'modelopt_quant',
    'moe_dense_tp_size', 'mooncake_ib_device', 'msprobe_dump_config', 'nccl_port', 'numa_node', 'otlp_service_name',
    'page_size', 'paged_experts_num_resident', 'pdmux_config_path', 'ple_offload_dir', 'ple_offload_embedding',
    'pp_max_micro_batch_size', 'preferred_sampling_params', 'prefill_attention_backend', 'prefill_decode_interval',
    'prefill_delayer_forward_passes_buckets', 'prefill_delayer_max_delay_ms', 'prefill_delayer_queue_min_ratio',
    'prefill_delayer_token_usage_low_watermark', 'prefill_delayer_wait_seconds_buckets', 'prefill_max_requests',
    'prompt_tokens_buckets', 'quantization', 'quantization_param_path', 'radix_cache_backend',
    'radix_eviction_policy_config', 'random_seed', 'reasoning_parser',
    'remote_instance_weight_loader_seed_instance_ip', 'remote_instance_weight_loader_seed_instance_service_port',
    'remote_instance_weight_loader_send_weights_group_ports', 'return_aux_hidden_state_layer_ids',
    'return_hidden_states_mode', 'revision', 'rl_on_policy_target', 'rl_quant_profile', 'sampling_backend',
    'served_model_name', 'shared_experts_tp_size', 'sidecar', 'sidecar_args', 'smg_http_sidecar_port',
    'soft_watchdog_timeout', 'spec_trace_dir', 'speculative_adaptive_config', 'speculative_algorithm',
    'speculative_dflash_block_size', 'speculative_draft_attention_backend', 'speculative_draft_kv_cache_dtype',
    'speculative_draft_load_format', 'speculative_draft_model_path', 'speculative_draft_model_quantization',
    'speculative_draft_model_revision', 'speculative_draft_sink_size', 'speculative_draft_window_size',
    'speculative_dspark_block_size', 'speculative_dspark_confidence_sts_path', 'speculative_dspark_sps_table_path',
    'speculative_eagle_topk', 'speculative_enable_w4a4_mxfp4_megamoe', 'speculative_moe_a2a_backend',
    'speculative_moe_runner_backend', 'speculative_ngram_external_corpus_path', 'speculative_num_draft_tokens',
    'speculative_num_steps', 'speculative_token_map', 'ssl_ca_certs', 'ssl_certfile', 'ssl_keyfile',
    'ssl_keyfile_password', 'stat_loggers', 'swa_full_tokens_ratio', 'swa_prefix_tails',
    'tokenizer_metrics_allowed_custom_labels', 'tokenizer_path', 'tool_call_parser', 'tool_server',
    'triton_attention_split_tile_size', 'unified_cache_external_linker_config', 'uno_lora_path', 'warmups',
    'watermark_config', 'watermark_key', 'watermark_key_b', 'weight_cache_socket'
})

CHOICES: dict[str, tuple[Any, ...]] = {
    'attention_backend': (
        'triton', 'torch_native', 'flex_attention', 'dsa', 'nsa', 'qsa', 'dsv4', 'compressed', 'fa3', 'fa4',
        'flashinfer', 'llada2_cfg_flashinfer', 'flashmla', 'trtllm_mla', 'cutedsl_mla', 'tokenspeed_mla',
        'trtllm_mha', 'hpc_ops', 'minicpm_flashattn', 'minicpm_flashinfer', 'aiter', 'wave', 'intel_amx', 'ascend',
        'intel_xpu',
    ),
    'bf16_gemm_backend': ('auto', 'cutedsl', 'gemv', 'torch',),
    'boundary_reduction': ('auto', 'ar', 'rs', 'rsv', 'rs+rsv',),
    'cp_strategy': ('zigzag', 'interleave',),
    'cuda_graph_backend_decode': ('full', 'breakable', 'disabled',),
    'cuda_graph_backend_prefill': ('full', 'breakable', 'disabled',),
    'dcp_comm_backend': ('ag_rs', 'a2a', 'fi_a2a',),
    'decode_attention_backend': (
        'triton', 'torch_native', 'flex_attention', 'dsa', 'nsa', 'qsa', 'dsv4', 'compressed', 'fa3', 'fa4',
        'flashinfer', 'llada2_cfg_flashinfer', 'flashmla', 'trtllm_mla', 'cutedsl_mla', 'tokenspeed_mla',
        'trtllm_mha', 'hpc_ops', 'minicpm_flashattn', 'minicpm_flashinfer', 'aiter', 'wave', 'intel_amx', 'ascend',
        'intel_xpu',
    ),
    'decoupled_spec_role': ('null', 'verifier', 'drafter',),
    'deepep_dispatcher_output_dtype': ('auto', 'bf16', 'fp8', 'int8', 'nvfp4',),
    'deepep_mode': ('auto', 'normal', 'low_latency',),
    'deepep_v2_mode': ('direct', 'hybrid',),
    'disaggregation_decode_allocation_policy': ('early', 'prefill_complete',),
    'disaggregation_decode_retraction_backup': ('cpu_tensor', 'host_pool', 'none',),
    'disaggregation_mode': ('null', 'prefill', 'decode',),
    'disaggregation_transfer_backend': ('mooncake', 'nixl', 'ascend', 'fake', 'mori', 'mooncake_tcp',),
    'dsa_decode_backend': (
        'flashmla_sparse', 'flashmla_sparse_q8', 'flashmla_kv', 'flashmla_auto', 'flashinfer_sparse_mla', 'fa3',
        'tilelang', 'triton', 'aiter', 'trtllm', 'intel_xpu',
    ),
    'dsa_paged_mqa_logits_backend': ('auto', 'deepgemm', 'cutedsl', 'aiter',),
    'dsa_prefill_backend': (
        'flashmla_sparse', 'flashmla_sparse_q8', 'flashmla_kv', 'flashmla_auto', 'flashinfer_sparse_mla',
        'triton_sparse_mla', 'fa3', 'tilelang', 'triton', 'aiter', 'trtllm', 'intel_xpu',
    ),
    'dsa_topk_backend': ('sgl-kernel', 'torch', 'flashinfer',),
    'dsa_triton_union': (0, 2, 4,),
    'dsv4_attn_backend': ('auto', 'flashmla', 'flashmla_mega', 'trtllm',),
    'dsv4_prefill_backend': ('auto', 'flashmla_sparse', 'flashmla_sparse_q8',),
    'dtype': ('auto', 'half', 'float16', 'bfloat16', 'float', 'float32',),
    'elastic_ep_backend': ('none', 'mooncake', 'nixl',),
    'encoder_transfer_backend': ('auto', 'zmq_to_scheduler', 'zmq_to_tokenizer', 'mooncake',),
    'ep_dispatch_algorithm': ('static', 'dynamic', 'fake', 'lp',),
    'ep_join_mode': ('scale', 'recover',),
    'expert_balancedness_report_mode': ('off', 'server_log', 'prometheus', 'both',),
    'expert_distribution_recorder_mode': ('stat', 'stat_approx', 'per_pass', 'per_token',),
    'flashinfer_a2a_dispatch_type': ('auto', 'bf16', 'nvfp4', 'mxfp8',),
    'flashinfer_allreduce_fusion_backend': ('auto', 'trtllm', 'mnnvl', 'cutedsl',),
    'flashinfer_mxfp4_moe_precision': ('default', 'bf16', 'fp8',),
    'fp4_gemm_runner_backend': (
        'auto', 'flashinfer_cudnn', 'flashinfer_cutedsl', 'flashinfer_cutlass', 'flashinfer_trtllm', 'marlin',
    ),
    'fp8_gemm_runner_backend': (
        'auto', 'deep_gemm', 'flashinfer_trtllm', 'flashinfer_cutlass', 'flashinfer_deepgemm', 'flashinfer_cutedsl',
        'cutlass', 'triton', 'aiter',
    ),
    'fuseep_mode': (1, 2,),
    'grammar_backend': ('xgrammar', 'outlines', 'llguidance', 'none',),
    'hicache_host_memory_mode': ('cache', 'buffer_only',),
    'hicache_io_backend': ('direct', 'kernel', 'kernel_ascend',),
    'hicache_mem_layout': ('layer_first', 'page_first', 'page_first_direct', 'page_first_kv_split', 'page_head',),
    'hicache_storage_backend': (
        'file', 'sim', 'mooncake', 'npu_memcache', 'hf3fs', 'nixl', 'aibrix', 'dynamic', 'eic', 'simm', 'mori', 'shm',
        'tensorcast', 'seaweedfs',
    ),
    'hicache_storage_prefetch_policy': ('best_effort', 'wait_complete', 'timeout',),
    'hicache_write_policy': ('write_back', 'write_through', 'write_through_selective',),
    'image_processor_backend': ('auto', 'torchvision', 'pil',),
    'kv_cache_dtype': ('auto', 'fp8_e5m2', 'fp8_e4m3', 'mxfp8', 'bf16', 'bfloat16', 'nvfp4', 'fp4_mx_block16',),
    'kv_canary': ('none', 'log', 'raise',),
    'linear_attn_backend': (
        'triton', 'cutedsl', 'flashinfer', 'flashkda', 'nvidia_kda', 'ptx_kda', 'helion', 'intel_xpu',
    ),
    'linear_attn_decode_backend': (
        'triton', 'cutedsl', 'flashinfer', 'flashkda', 'nvidia_kda', 'ptx_kda', 'helion', 'intel_xpu',
    ),
    'linear_attn_prefill_backend': (
        'triton', 'cutedsl', 'flashinfer', 'flashkda', 'nvidia_kda', 'ptx_kda', 'helion', 'intel_xpu',
    ),
    'load_balance_method': ('auto', 'round_robin', 'follow_bootstrap_room', 'total_requests', 'total_tokens',),
    'load_format': (
        'auto', 'pt', 'safetensors', 'instanttensor', 'npcache', 'dummy', 'sharded_state', 'presharded', 'gguf',
        'expert_pack', 'bitsandbytes', 'mistral', 'layered', 'flash_rl', 'remote', 'remote_instance',
        'fastsafetensors', 'private', 'runai_streamer',
    ),
    'log_requests_format': ('text', 'json',),
    'log_requests_level': (0, 1, 2, 3,),
    'lora_backend': ('triton', 'csgmv', 'ascend', 'torch_native', 'triton_v2',),
    'lora_eviction_policy': ('lru', 'fifo',),
    'mamba_backend': ('triton', 'flashinfer',),
    'mamba_radix_cache_strategy': ('auto', 'no_buffer', 'extra_buffer', 'extra_buffer_lazy',),
    'mamba_ssm_dtype': ('float32', 'bfloat16', 'float16',),
    'max_lora_chunk_size': (16, 32, 64, 128,),
    'mm_attention_backend': (
        'sdpa', 'fa3', 'fa4', 'triton_attn', 'ascend_attn', 'aiter_attn', 'flashinfer_cudnn', 'amx_attn', 'xpu_attn',
    ),
    'mm_feature_transport': ('cpu', 'cuda_ipc', 'cuda_vmm',),
    'mm_global_cache_backend': ('mooncake',),
    'moe_a2a_backend': (
        'none', 'deepep', 'mooncake', 'nixl', 'mori', 'ascend_fuseep', 'flashinfer', 'megamoe', 'deepep_v2', 'pplx',
        'ascend_tp', 'flashinfer_megamoe',
    ),
    'moe_runner_backend': (
        'auto', 'deep_gemm', 'triton', 'triton_kernel', 'flashinfer_trtllm', 'experimental_sgl_trtllm',
        'flashinfer_trtllm_routed', 'flashinfer_cutlass', 'flashinfer_mxfp4', 'flashinfer_cutedsl',
        'flashinfer_megamoe', 'cutlass', 'aiter', 'marlin', 'humming', 'experimental_sgl_marlin', 'lora_cutedsl',
        'lora_triton', 'lora_marlin', 'hpc_ops', 'megamoe', 'intel_xpu',
    ),
    'ple_offload_backend': ('pinned', 'file',),
    'prefill_attention_backend': (
        'triton', 'torch_native', 'flex_attention', 'dsa', 'nsa', 'qsa', 'dsv4', 'compressed', 'fa3', 'fa4',
        'flashinfer', 'llada2_cfg_flashinfer', 'flashmla', 'trtllm_mla', 'cutedsl_mla', 'tokenspeed_mla',
        'trtllm_mha', 'hpc_ops', 'minicpm_flashattn', 'minicpm_flashinfer', 'aiter', 'wave', 'intel_amx', 'ascend',
        'intel_xpu',
    ),
    'prefill_kv_cache_dequant_dtype': ('auto', 'nvfp4', 'fp8_e4m3',),
    'qsa_indexer_dtype': ('auto', 'bfloat16', 'fp8_e4m3',),
    'quantization': (
        'awq', 'fp8', 'mxfp8', 'gptq', 'gptq_marlin', 'awq_marlin', 'bitsandbytes', 'gguf', 'modelopt',
        'modelopt_fp8', 'modelopt_fp4', 'nvfp4_online', 'modelopt_mixed', 'petit_nvfp4', 'w8a8_int8', 'w8a8_fp8',
        'moe_wna16', 'w4afp8', 'mxfp4', 'auto-round', 'auto-round-int8', 'compressed-tensors', 'modelslim',
        'mxfp_w4a8', 'quark', 'quark_int4fp8_moe', 'quark_mxfp4', 'mlx_q4', 'mlx_q8', 'unquant', 'humming',
    ),
    'radix_eviction_policy': ('lru', 'lfu', 'slru', 'priority', 'tlru',),
    'remote_instance_weight_loader_backend': ('transfer_engine', 'nccl', 'modelexpress',),
    'retraction_policy': ('length', 'priority',),
    'return_hidden_states_mode': ('last', 'full',),
    'rl_on_policy_target': ('fsdp',),
    'sampling_defaults': ('openai', 'model',),
    'schedule_policy': (
        'lpm', 'random', 'fcfs', 'dfs-weight', 'lof', 'priority', 'routing-key', 'hrrn', 'shortest-prefill-first',
    ),
    'speculative_attention_mode': ('prefill', 'decode',),
    'speculative_boundary_reduction': ('ar', 'rs', 'rsv', 'rs+rsv',),
    'speculative_draft_kv_cache_dtype': ('auto', 'fp8_e5m2', 'fp8_e4m3', 'bf16', 'bfloat16',),
    'speculative_draft_load_format': (
        'auto', 'pt', 'safetensors', 'instanttensor', 'npcache', 'dummy', 'sharded_state', 'presharded', 'gguf',
        'expert_pack', 'bitsandbytes', 'mistral', 'layered', 'flash_rl', 'remote', 'remote_instance',
        'fastsafetensors', 'private', 'runai_streamer',
    ),
    'speculative_draft_model_quantization': (
        'awq', 'fp8', 'mxfp8', 'gptq', 'gptq_marlin', 'awq_marlin', 'bitsandbytes', 'gguf', 'modelopt',
        'modelopt_fp8', 'modelopt_fp4', 'nvfp4_online', 'modelopt_mixed', 'petit_nvfp4', 'w8a8_int8', 'w8a8_fp8',
        'moe_wna16', 'w4afp8', 'mxfp4', 'auto-round', 'auto-round-int8', 'compressed-tensors', 'modelslim',
        'mxfp_w4a8', 'quark', 'quark_int4fp8_moe', 'quark_mxfp4', 'mlx_q4', 'mlx_q8', 'unquant', 'humming',
    ),
    'speculative_dsa_topk_backend': ('sgl-kernel', 'torch', 'flashinfer',),
    'speculative_moe_a2a_backend': (
        'none', 'deepep', 'mooncake', 'nixl', 'mori', 'ascend_fuseep', 'flashinfer', 'megamoe', 'deepep_v2', 'pplx',
        'ascend_tp',
    ),
    'speculative_moe_runner_backend': (
        'auto', 'deep_gemm', 'triton', 'triton_kernel', 'flashinfer_trtllm', 'experimental_sgl_trtllm',
        'flashinfer_trtllm_routed', 'flashinfer_cutlass', 'flashinfer_mxfp4', 'flashinfer_cutedsl',
        'flashinfer_megamoe', 'cutlass', 'aiter', 'marlin', 'humming', 'experimental_sgl_marlin', 'lora_cutedsl',
        'lora_triton', 'lora_marlin', 'hpc_ops', 'megamoe', 'intel_xpu',
    ),
    'speculative_ngram_match_type': ('BFS', 'PROB',),
    'startup_weight_load_mode': ('serial', 'overlap',),
    'tokenizer_backend': ('huggingface', 'fastokens',),
    'tokenizer_mode': ('auto', 'slow',),
    'unified_cache_external_linker_backend': ('mooncake', 'mori', 'dynamic',),
    'weight_cache_mode': ('off', 'daemon', 'client',),
}

SERVER_ARG_NAMES = BOOL_FIELDS | INT_FIELDS | FLOAT_FIELDS | STR_FIELDS | OTHER_FIELDS

# ServerArgs the adapter sets (rollout/sglang/__init__.py, engine_transport.py) or fixes: engine_kwargs.sglang may
# not set them, so one setting never has two spellings. name -> where it comes from.
OWNED_SERVER_ARGS: dict[str, str] = {
    "model_path": "actor_rollout_ref.model.path",
    "tp_size": f"{ROLLOUT}.tensor_model_parallel_size",
    "mem_fraction_static": f"{ROLLOUT}.gpu_memory_utilization",
    "dtype": f"{ROLLOUT}.dtype",
    "random_seed": f"{ROLLOUT}.seed",
    "base_gpu_id": "fixed: the replica's first GPU (rollout/mesh.py)",
    "nccl_port": f"{ROLLOUT}.sglang.port_base and port_stride",
    "port": f"{ROLLOUT}.sglang.port_base and port_stride",
    "json_model_override_args": "actor_rollout_ref.model.override_config",
    "enable_return_routed_experts": f"{ROLLOUT}.enable_rollout_routing_replay",
    "enable_memory_saver": "fixed: true (sleep releases weights, KV cache and CUDA graphs)",
    "load_format": "fixed: dummy (the weights arrive by sync)",
    "skip_tokenizer_init": "fixed: true (token ids in, token ids out)",
    "log_level": "fixed: error",
    # one engine spans one replica's rollout.tensor_model_parallel_size GPUs on one node (rollout/mesh.py)
    "dp_size": f"fixed: 1; more engines come from more replicas ({ROLLOUT}.tensor_model_parallel_size)",
    "pp_size": "fixed: 1 (one engine spans the replica's TP ranks)",
    "nnodes": "fixed: 1 (one engine spans one replica on one node)",
    "node_rank": "fixed: 0 (one engine spans one replica on one node)",
    "dist_init_addr": "fixed: unset (one engine spans one replica on one node)",
    "gpu_id_step": "fixed: 1 (the replica's GPUs are consecutive)",
}

_TYPES: tuple[tuple[frozenset[str], tuple[type, ...], str], ...] = (
    (BOOL_FIELDS, (bool,), "a boolean"),
    (INT_FIELDS, (int,), "an integer"),
    (FLOAT_FIELDS, (int, float), "a number"),
    (STR_FIELDS, (str,), "a string"),
)


def check_engine_kwargs(kwargs: Mapping[str, Any], tp_size: int, key: str = f"{ROLLOUT}.engine_kwargs.sglang") -> None:
    """Refuse names that are not SGLang ServerArgs (with the closest real name), names the adapter sets itself
    (with the rollout key to use), values of the wrong type or outside a closed choice, and an expert-parallel
    layout SGLang cannot build on ``tp_size`` (rollout.tensor_model_parallel_size) ranks."""
    problems = [problem for name in sorted(kwargs) if (problem := _problem(name, kwargs[name], key))]
    if "ep_size" in kwargs and not problems:
        problems += _ep_problems(kwargs["ep_size"], tp_size, key)
    if problems:
        raise ConfigError("; ".join(problems))


def _problem(name: str, value: Any, key: str) -> str | None:
    problem = name_problem(name, key, SERVER_ARG_NAMES, OWNED_SERVER_ARGS, "an SGLang 0.5.23 ServerArgs field")
    if problem is not None:
        return problem
    if value is None:
        return None if name in OPTIONAL_FIELDS else f"{key}.{name}=None: SGLang's {name} may not be None"
    for names, types, what in _TYPES:
        if name in names and (isinstance(value, bool) and bool not in types or not isinstance(value, types)):
            return f"{key}.{name}={value!r} must be {what} (SGLang's ServerArgs.{name})"
    if name in CHOICES and value not in CHOICES[name]:
        return f"{key}.{name}={value!r} is not one of SGLang's choices {list(CHOICES[name])}"
    return None


def _ep_problems(ep: int, tp_size: int, key: str) -> list[str]:
    """SGLang splits an engine's tp_size ranks into ep_size expert groups of tp_size // ep_size ranks each
    (srt/runtime_context.py derive_parallel_widths: moe_tp_size); a remainder breaks its group layout."""
    if ep < 1 or tp_size % ep:
        return [f"{key}.ep_size={ep} must be >= 1 and divide {ROLLOUT}.tensor_model_parallel_size={tp_size} (SGLang's "
                f"tp_size: each of its ep_size expert groups spans tp_size // ep_size ranks); set ep_size to one of "
                f"{[d for d in range(1, tp_size + 1) if tp_size % d == 0]}"]
    return []
