"""The server's Prometheus metrics, in a registry of its own (one per app: no process-global state).

kiln_requests_running / kiln_requests_waiting   sequences in the engine's running / waiting queues
kiln_kv_blocks_used / kiln_kv_blocks_total      KV-cache pages held by sequences (prefix-cached free
                                                pages count as free) / all pages
kiln_prompt_tokens_total / kiln_generation_tokens_total   tokens admitted / sampled
kiln_time_to_first_token_seconds    HTTP arrival -> first token of each completion (histogram)
kiln_inter_token_latency_seconds    time between a completion's consecutive tokens (histogram)
kiln_e2e_request_latency_seconds    HTTP arrival -> last token of a prompt (histogram)
kiln_requests_finished_total{finish_reason}       completions by finish reason (stop, length, abort)
kiln_requests_rejected_total        requests refused with 503 because the server was at capacity
kiln_admission_latency_seconds      submission to the engine's acceptance (the request is then in its queue)
kiln_engine_intake_requests         requests the engine took in one intake, before one step (histogram: its
                                    count is the intakes, its sum the requests)
kiln_engine_steps_total             engine steps run
kiln_event_loop_lag_seconds         how late the event loop ran a callback due every LOOP_PROBE_S (histogram:
                                    a loop buried under work delays every request's admission by as much)
kiln_admission_stage_seconds{stage} where an intake's admission time goes, per command or intake
                                    (histogram): batch (a command's oldest add waiting for the end of
                                    the event loop's tick to leave with the others), command (the add command from the HTTP side until the engine takes it),
                                    intake (the engine's first command taken -> its reply made), sender (the
                                    reply made -> framed for writing in the engine process), pipe (framed
                                    -> read and handled in this process), event_loop (handled -> the
                                    requests settled by the event loop); sender and pipe are the process
                                    transport's only
kiln_engine_step_seconds            the wall time of each engine step (LLMEngine.step, host and device)
kiln_engine_reply_lag_seconds       the engine process's message (a step's outputs, an intake's answer) to
                                    its handling in this process's event loop (histogram; `kiln serve`'s
                                    process transport only)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# seconds; the ranges of a CPU test model up to a 1.5B model's long prompts on a GPU
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
ADMISSION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
INTAKE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
STAGE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ADMISSION_STAGES = ("batch", "command", "intake", "sender", "pipe", "event_loop")
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    def __init__(self, num_blocks: int):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.running = Gauge("kiln_requests_running", "Sequences in the engine's running queue", registry=r)
        self.waiting = Gauge("kiln_requests_waiting", "Sequences in the engine's waiting queue", registry=r)
        self.kv_blocks_used = Gauge("kiln_kv_blocks_used", "KV-cache blocks held by sequences", registry=r)
        total = Gauge("kiln_kv_blocks_total", "KV-cache blocks in all", registry=r)
        total.set(num_blocks)
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("kiln_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "kiln_time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "kiln_inter_token_latency_seconds", "Time between tokens", buckets=ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "kiln_e2e_request_latency_seconds", "Arrival to last token", buckets=E2E_BUCKETS, registry=r
        )
        self.finished = Counter(
            "kiln_requests_finished", "Completions by finish reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter("kiln_requests_rejected", "Requests refused at capacity (503)", registry=r)
        self.admission = Histogram(
            "kiln_admission_latency_seconds",
            "Submission to the engine's acceptance",
            buckets=ADMISSION_BUCKETS,
            registry=r,
        )
        self.intake = Histogram(
            "kiln_engine_intake_requests",
            "Requests the engine took before one step",
            buckets=INTAKE_BUCKETS,
            registry=r,
        )
        self.steps = Counter("kiln_engine_steps", "Engine steps run", registry=r)
        self.step_seconds = Histogram(
            "kiln_engine_step_seconds", "Wall time of an engine step", buckets=STEP_BUCKETS, registry=r
        )
        stage = Histogram(
            "kiln_admission_stage_seconds",
            "Where an intake's admission time goes",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.stage = {name: stage.labels(stage=name) for name in ADMISSION_STAGES}
        self.loop_lag = Histogram(
            "kiln_event_loop_lag_seconds", "Event loop lateness", buckets=LAG_BUCKETS, registry=r
        )
        self.reply_lag = Histogram(
            "kiln_engine_reply_lag_seconds", "Engine message to its handling", buckets=LAG_BUCKETS, registry=r
        )
