"""Golden field layouts (key order included) of the real servers' responses.

Derived by reading the pydantic models of the released sources through the code index and the
byte-exact findings in docs/reference.md ("Wire formats"):
- vLLM (the 0.33.0 sources) `entrypoints/openai/chat_completion/protocol.py`: ChatCompletionResponse (id, object,
  created, model, choices, service_tier, system_fingerprint, usage, prompt_logprobs,
  prompt_token_ids, prompt_text, kv_transfer_params), ChatCompletionResponseChoice (index, message,
  logprobs, finish_reason, stop_reason, token_ids), ChatMessage (role, content, refusal,
  annotations, audio, function_call, tool_calls [dropped when empty], reasoning),
  ChatCompletionLogProbsContent (token, logprob, bytes, top_logprobs). Non-streaming answers are
  full dumps; stream chunks are exclude_unset dumps (see dialect_vllm.py).
  The vLLM lists below are those of the real vLLM 0.32.0 (measured), which adds routed_experts,
  ec_transfer_params and metrics, and no kv_transfer_params on stream chunks.
- SGLang 0.5.23 `srt/entrypoints/openai/protocol.py`: ChatCompletionResponse (id, object, created,
  model, choices, usage, metadata; sglext dropped when None), ChatCompletionResponseChoice (index,
  message, logprobs, finish_reason, matched_stop; hidden_states / prompt_token_ids / token ids /
  meta_info dropped when None), ChatMessage (role, content, reasoning_content, tool_calls),
  DeltaMessage (role, content, reasoning_content, tool_calls), stream choice (index, delta,
  logprobs, finish_reason, matched_stop), UsageInfo (prompt_tokens, total_tokens,
  completion_tokens, prompt_tokens_details, reasoning_tokens). The token-id field of the choice is
  `response_token_ids` as docs/reference.md records for 0.5.23 (later sources name it `token_ids`).
"""
# vLLM: as the real vLLM 0.32.0 answers (tests/vllm/test_differential.py compares the whole answers).
VLLM_CHAT = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
             "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics"]
VLLM_CHOICE = ["index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts"]
VLLM_MESSAGE = ["role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"]
VLLM_MESSAGE_TOOLS = ["role", "content", "refusal", "annotations", "audio", "function_call", "tool_calls", "reasoning"]
VLLM_LOGPROB = ["token", "logprob", "bytes", "top_logprobs"]
VLLM_FIRST_CHUNK = ["id", "object", "created", "model", "choices", "prompt_token_ids", "prompt_text"]
VLLM_CHUNK = ["id", "object", "created", "model", "choices"]  # the finishing chunk adds system_fingerprint
VLLM_USAGE_CHUNK = ["id", "object", "created", "model", "choices", "usage", "system_fingerprint"]
VLLM_COMPLETION_CHOICE = ["index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
                          "prompt_logprobs", "prompt_token_ids", "routed_experts"]

SGL_CHAT = ["id", "object", "created", "model", "choices", "usage", "metadata"]
SGL_CHOICE = ["index", "message", "logprobs", "finish_reason", "matched_stop"]
SGL_MESSAGE = ["role", "content", "reasoning_content"]  # ChatMessage drops tool_calls when None
SGL_MESSAGE_TOOLS = ["role", "content", "reasoning_content", "tool_calls"]
SGL_LOGPROB = ["token", "bytes", "logprob", "top_logprobs"]
# Streams: the role, reasoning, plain-content, logprob-only and finish chunks are sse_utils msgspec
# structs (omit_defaults: no `usage` key; delta {reasoning_content, role?, content?}); tool-call-path,
# sglext and usage chunks are pydantic ChatCompletionStreamResponse dumps.
SGL_CHUNK = ["id", "object", "created", "model", "choices"]
SGL_MODEL_CHUNK = ["id", "object", "created", "model", "choices", "usage"]
SGL_STREAM_CHOICE = ["index", "delta", "logprobs", "finish_reason", "matched_stop"]
SGL_DELTAS = (["reasoning_content"], ["reasoning_content", "role", "content"], ["reasoning_content", "content"])
SGL_MODEL_DELTA = ["role", "content", "reasoning_content", "tool_calls"]
SGL_USAGE = ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details", "reasoning_tokens",
             "completion_tokens_details"]
