//! The OpenAPI 3.1 description served at `/openapi.json`.

use serde_json::{json, Value};

fn error_response(description: &str) -> Value {
    json!({
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    })
}

fn ok(description: &str, schema: &str) -> Value {
    json!({
        "description": description,
        "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}
    })
}

fn body(schema: &str, required: bool) -> Value {
    json!({
        "required": required,
        "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}
    })
}

fn param(name: &str, location: &str, description: &str, schema: Value) -> Value {
    json!({
        "name": name,
        "in": location,
        "required": location == "path",
        "description": description,
        "schema": schema,
    })
}

fn run_id() -> Value {
    param("run_id", "path", "The run.", json!({"type": "string"}))
}

fn min_position() -> Value {
    param(
        "min_position",
        "query",
        "Wait (bounded) until the view has applied this log position (from a write's answer); also the `Sortie-Min-Position` header.",
        json!({"type": "string", "example": "p2:o1534"}),
    )
}

fn idempotency_key() -> Value {
    param(
        "Idempotency-Key",
        "header",
        "Used as the command id: a retry with the same key is answered, not applied again.",
        json!({"type": "string", "maxLength": 200}),
    )
}

/// The payload rule every JSON payload of a request is held to, in words.
fn shape() -> String {
    use sortie_core::limits::{MAX_DEPTH, MAX_KEY_BYTES, MAX_MEMBERS, MAX_STRING_BYTES};
    format!(
        "at most {MAX_DEPTH} levels of nested objects and arrays, {MAX_MEMBERS} members in one object or array, {MAX_KEY_BYTES}-byte keys and {MAX_STRING_BYTES}-byte strings"
    )
}

fn write_errors(mut responses: Value) -> Value {
    let bad_request = format!(
        "`bad_json`: the body is not JSON. `invalid_request`: a missing or invalid field, or a command the reducer would refuse to read (the message says why). `limit_exceeded`: a payload (input, payload, edited_args, result, input_patch), the labels or a text (comment, reason, error) past its limit; `limit` names it (`depth`, `members`, `key_bytes`, `string_bytes`: {}; `labels`: at most {} labels, names that are ids, values up to {} bytes; `text_bytes`: up to {} bytes) and `at` where (e.g. `input.order.items[3]`; `body` for a body nested too deep to parse). Also `invalid_run_id`, `invalid_idempotency_key`. Nothing is published.",
        shape(),
        sortie_core::limits::MAX_LABELS,
        sortie_core::limits::MAX_TEXT_BYTES,
        sortie_core::limits::MAX_TEXT_BYTES,
    );
    responses["400"] = error_response(&bad_request);
    for (code, text) in [
        ("401", "No bearer token, an unknown static token, or a JWT that does not verify (signature, issuer, audience, expiry, tenant claim)."),
        ("403", "Forbidden: another tenant's namespace, or the reducer's `forbidden` (missing role)."),
        ("404", "Unknown run (also another tenant's run)."),
        ("500", "run_unreadable: this gateway's view could not read or store the run and set it aside (quarantined); `run_id` names it. Other runs are served."),
        ("409", "Refused by the reducer: conflict, bad_state, stale_proposal, already_decided, expired, duplicate_approver, unknown_interrupt, unknown_operation."),
        ("408", "body_timeout: the body did not arrive within --body-read-timeout-ms of the headers; the connection closes."),
        ("413", "The body is larger than the configured cap."),
        ("503", "Nothing was published, or its outcome is not known: kafka_unavailable, registry_unavailable, blob_store_unavailable, key_store_unavailable."),
        ("504", "The reducer's answer did not arrive in time; the error carries the command_id."),
    ] {
        responses[code] = error_response(text);
    }
    responses
}

fn read_errors(mut responses: Value) -> Value {
    for (code, text) in [
        ("401", "No bearer token, an unknown static token, or a JWT that does not verify (signature, issuer, audience, expiry, tenant claim)."),
        ("404", "Unknown run (also another tenant's run)."),
        ("500", "run_unreadable: this gateway's view could not read or store the run and set it aside (quarantined); `run_id` names it. Other runs are served."),
        ("504", "The view did not reach min_position in time."),
    ] {
        responses[code] = error_response(text);
    }
    responses
}

/// The whole document.
pub fn document() -> Value {
    let security = json!([{"bearer": []}]);
    let mut doc = json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Sortie gateway",
            "version": env!("CARGO_PKG_VERSION"),
            "description": format!("Durable execution for long-running AI agent runs. Writes become Kafka commands answered by the reducer; reads come from a local view of run-state and run-events. Every error is {{\"error\": {{\"code\", \"message\"}}}}. Every JSON payload has {}; past a limit the answer is 400 limit_exceeded naming `limit` and `at`.", shape())
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {"error": {
                        "type": "object",
                        "required": ["code", "message"],
                        "properties": {
                            "code": {"type": "string"},
                            "message": {"type": "string"},
                            "command_id": {"type": "string"},
                            "position": {"type": "string"},
                            "limit": {"type": "string", "description": "limit_exceeded: the limit broken (depth, members, key_bytes, string_bytes, labels, text_bytes)."},
                            "at": {"type": "string", "description": "limit_exceeded: where, e.g. input.order.items[3], or body."},
                            "run_id": {"type": "string"}
                        }
                    }}
                },
                "StartRun": {
                    "type": "object",
                    "required": ["graph_id"],
                    "additionalProperties": false,
                    "properties": {
                        "graph_id": {"type": "string"},
                        "graph_version": {"type": "integer", "minimum": 0},
                        "input": {"description": "Any JSON of the payload shape (see the 400 answer); `{}` when absent."},
                        "checkpoint_ns": {"type": "string", "description": "The tenant; must be the token's."},
                        "run_id": {"type": "string", "description": "Client-chosen id; `run_<ulid>` when absent."},
                        "labels": {"type": "object", "additionalProperties": {"type": "string"}}
                    }
                },
                "Resume": {
                    "type": "object",
                    "required": ["decision"],
                    "additionalProperties": false,
                    "properties": {
                        "decision": {"enum": ["approve", "reject"]},
                        "interrupt_id": {"type": "string", "description": "May be omitted when exactly one interrupt of the run is open; with several open the answer is 409 ambiguous_interrupt listing them (open_interrupts)."},
                        "proposal_hash": {"type": "string", "description": "The proposal approved; defaults to the interrupt's current one."},
                        "payload": {"description": "The human's input, delivered to the node ($interrupt.payload in its arguments, its precheck's and its on_reject substitute's). Compatibility: without edited_args, a payload that is the proposal's whole argument object with some values changed is read as edited arguments (its pre-0.2 meaning)."},
                        "edited_args": {"type": "object", "description": "Arguments to run instead of the proposal's; unless the node allows edits, they become a new proposal that needs its own approval."},
                        "comment": {"type": "string"}
                    }
                },
                "Why": {
                    "type": "object",
                    "required": ["operation_id", "run_id", "tenant", "verified", "links"],
                    "properties": {
                        "operation_id": {"type": "string"},
                        "run_id": {"type": "string"},
                        "tenant": {"type": "string"},
                        "verified": {"type": "boolean", "description": "Every link verified."},
                        "links": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["link", "status", "facts"],
                                "properties": {
                                    "link": {"type": "string", "enum": ["history", "effect", "graph", "approval", "proposal", "request"]},
                                    "status": {"type": "string", "enum": ["verified", "broken", "unchecked"]},
                                    "facts": {"type": "object", "description": "What the link is about, as read and recomputed."},
                                    "problems": {"type": "array", "items": {"type": "string"}, "description": "Why it is broken or cannot be checked."}
                                }
                            }
                        }
                    }
                },
                "Fork": {
                    "type": "object",
                    "required": ["at_version"],
                    "additionalProperties": false,
                    "properties": {
                        "at_version": {"type": "integer", "description": "The source's state version (ckpt_<run>_<version>)."},
                        "input_patch": {"description": "A JSON merge patch (RFC 7386) applied to the source's input."},
                        "run_id": {"type": "string", "description": "The new run's id, on the source's partition (422 fork_partition otherwise: the reducer that owns that partition checks the fork against the source's chain head); derived from Idempotency-Key, else run_<ulid>, on that partition."},
                        "labels": {"type": "object", "additionalProperties": {"type": "string"}, "description": "The new run's labels; the source's when absent."}
                    }
                },
                "Cancel": {
                    "type": "object",
                    "additionalProperties": false,
                    "properties": {"reason": {"type": "string"}}
                },
                "Signal": {
                    "type": "object",
                    "additionalProperties": false,
                    "properties": {
                        "payload": {"description": format!("The signal's payload (JSON; absent: null), held to the wait's schema; {}. Travels inline: pass large artifacts by URI.", shape())},
                        "signal_id": {"type": "string", "maxLength": 256, "description": "The sender's id of this event: taken once per run, whatever request carries it (absent: the command id, i.e. the Idempotency-Key)."}
                    }
                },
                "CorrelatedSignal": {
                    "type": "object",
                    "required": ["graph_id", "correlation"],
                    "additionalProperties": false,
                    "properties": {
                        "graph_id": {"type": "string", "description": "A graph that declares a correlation label."},
                        "correlation": {"type": "string", "description": "The value of that label on the run (e.g. the hire's id): the run's id is cor_ + 32 hex digits of SHA-256 over \"sortie.correlation.v1\", tenant, graph id, label and value, each followed by 0x1f."},
                        "payload": {"description": "The signal's payload (JSON; absent: null), held to the wait's schema."},
                        "signal_id": {"type": "string", "maxLength": 256, "description": "The sender's id of this event: taken once per run."}
                    }
                },
                "SignalWritten": {
                    "type": "object",
                    "required": ["run_id", "status", "command_id", "position", "signal", "signal_id"],
                    "properties": {
                        "run_id": {"type": "string"},
                        "status": {"type": "string", "description": "The run's status after the signal."},
                        "command_id": {"type": "string"},
                        "position": {"type": "string", "description": "The answering event's log position, for min_position."},
                        "duplicate": {"type": "boolean"},
                        "signal": {"enum": ["taken", "kept", "duplicate"], "description": "taken: an open wait took it; kept: its wait has not opened yet and takes it when it does; duplicate: this signal id was taken or kept already."},
                        "signal_id": {"type": "string"}
                    }
                },
                "Reconcile": {
                    "type": "object",
                    "required": ["outcome"],
                    "additionalProperties": false,
                    "properties": {
                        "outcome": {"enum": ["succeeded", "failed"]},
                        "result": {"description": "The operation's output."},
                        "error": {"type": "string"}
                    }
                },
                "Written": {
                    "type": "object",
                    "required": ["run_id", "status", "command_id", "position"],
                    "properties": {
                        "run_id": {"type": "string"},
                        "status": {"type": "string"},
                        "command_id": {"type": "string"},
                        "position": {"type": "string", "description": "The answering event's log position, for min_position."},
                        "duplicate": {"type": "boolean"}
                    }
                },
                "Run": {
                    "type": "object",
                    "properties": {
                        "run_id": {"type": "string"},
                        "checkpoint_ns": {"type": "string"},
                        "graph_id": {"type": "string"},
                        "status": {"enum": ["running", "waiting_approval", "waiting_signal", "needs_reconciliation", "cancelling", "compensating", "succeeded", "failed", "cancelled"]},
                        "version": {"type": "integer"},
                        "last_checkpoint_id": {"type": "string"},
                        "steps_done": {"type": "integer"},
                        "nodes_completed": {"type": "array", "items": {"type": "string"}},
                        "interrupt": {"type": ["object", "null"]},
                        "interrupts": {"type": "array", "items": {"type": "object"}},
                        "waits": {"type": "array", "items": {"type": "object"}, "description": "The run's waits for signals: step_id, node, signal, many, wanted, expires_at, status (open, done, expired, closed), timed_out, received [{signal_id, payload, sent_by, at}], conversation (true: a conversation's wait for the person's next message, after the answer of step step_id)."},
                        "open_waits": {"type": "array", "items": {"type": "string"}, "description": "The names of the signals the run waits for now."},
                        "parent": {"type": ["object", "null"], "description": "For a child run: its parent's run_id, step_id, operation_id and attempt."},
                        "children": {"type": "array", "items": {"type": "object"}, "description": "The child runs this run started (its run: steps): step_id, node, run_id, attempt, status (the step's)."},
                        "steps": {"type": "array", "items": {"type": "object"}},
                        "budget": {"type": ["object", "null"], "description": "Spend limits (tokens, cost_usd, tool_calls, wall_time) and the price table, as started and raised."},
                        "spend": {"type": "object", "description": "What the run spent: prompt_tokens, completion_tokens, cost_usd, llm_calls, tool_calls."}
                    }
                },
                "RunList": {
                    "type": "object",
                    "properties": {
                        "runs": {"type": "array", "items": {"type": "object"}},
                        "next_after": {"type": ["string", "null"]}
                    }
                },
                "Conversation": {
                    "type": "object",
                    "required": ["run_id", "entries", "last_seq"],
                    "properties": {
                        "run_id": {"type": "string"},
                        "last_seq": {"type": "integer", "description": "The last event it was derived from."},
                        "entries": {"type": "array", "items": {
                            "type": "object",
                            "required": ["kind", "seq", "at", "node"],
                            "description": "kind message: role, text; model: step_id, text, tool_calls [{id, tool, arguments}], model, usage; approval: call_id, tool, step_id, interrupt_id, state (requested, approved, rejected, expired), by, comment; tool_result: call_id, tool, step_id, status, text.",
                            "properties": {
                                "kind": {"type": "string", "enum": ["message", "model", "approval", "tool_result"]},
                                "seq": {"type": "integer"},
                                "at": {"type": "integer", "description": "Unix ms."},
                                "node": {"type": "string", "description": "The tool-loop node whose conversation it is."}
                            }
                        }}
                    }
                },
                "EventPage": {
                    "type": "object",
                    "properties": {
                        "run_id": {"type": "string"},
                        "events": {"type": "array", "items": {"$ref": "#/components/schemas/Event"}},
                        "next_after": {"type": "integer"},
                        "has_more": {"type": "boolean"}
                    }
                },
                "Event": {
                    "type": "object",
                    "description": "An event as recorded (seq, state_version, at, body, ...) plus ts, node and type.",
                    "properties": {
                        "seq": {"type": "integer"},
                        "state_version": {"type": "integer"},
                        "at": {"type": "integer", "description": "Epoch milliseconds."},
                        "ts": {"type": "string", "format": "date-time", "description": "`at` as RFC 3339 (UTC)."},
                        "node": {"type": ["string", "null"], "description": "The node of the step the event concerns, else null."},
                        "type": {"type": "string", "description": "The event kind in snake_case, e.g. step_succeeded."},
                        "body": {"type": "object", "description": "The recorded event, keyed by its kind."}
                    }
                },
                "Checkpoint": {
                    "type": "object",
                    "properties": {
                        "checkpoint_id": {"type": "string"},
                        "version": {"type": "integer"},
                        "status": {"type": "string"},
                        "created_at": {"type": "string", "format": "date-time", "description": "When the checkpoint was made: its version's last event (RFC 3339)."},
                        "run_created_at": {"type": "integer", "description": "When the run was created (epoch milliseconds)."},
                        "nodes_completed": {"type": "array", "items": {"type": "string"}, "description": "The nodes completed at this checkpoint, in order."},
                        "state": {"type": "object"}
                    }
                }
            }
        },
        "paths": {
            "/v1/runs": {
                "post": {
                    "summary": "Start a run",
                    "security": security,
                    "parameters": [idempotency_key()],
                    "requestBody": body("StartRun", true),
                    "responses": write_errors(json!({
                        "201": ok("Accepted by the reducer.", "Written"),
                        "422": error_response("Unknown graph.")
                    }))
                },
                "get": {
                    "summary": "List the tenant's runs",
                    "security": security,
                    "parameters": [
                        param("status", "query", "Only runs with this status.", json!({"type": "string"})),
                        param("graph_id", "query", "Only runs of this graph.", json!({"type": "string"})),
                        param("limit", "query", "At most this many (1-500, default 50).", json!({"type": "integer"})),
                        param("after", "query", "The next_after of the previous page.", json!({"type": "string"})),
                        param("label", "query", "Only runs with this label, as key=value.", json!({"type": "string"})),
                        param("created_after", "query", "Only runs created at or after this time (Unix ms).", json!({"type": "integer"})),
                        param("created_before", "query", "Only runs created before this time (Unix ms).", json!({"type": "integer"})),
                        min_position()
                    ],
                    "responses": read_errors(json!({"200": ok("The runs.", "RunList")}))
                }
            },
            "/v1/runs/{run_id}": {
                "get": {
                    "summary": "A run: status, open interrupts, last checkpoint, steps",
                    "security": security,
                    "parameters": [run_id(), min_position()],
                    "responses": read_errors(json!({"200": ok("The run.", "Run")}))
                },
                "delete": {
                    "summary": "Delete a finished run (operator role): its data key is destroyed when payloads are sealed (crypto-shredding: its payloads no longer open on any topic), its state keeps its shape only, its step results are tombstoned; its history still verifies",
                    "security": security,
                    "parameters": [
                        run_id(),
                        idempotency_key(),
                        param("reason", "query", "Why (recorded in the run's RunForgotten event).", json!({"type": "string"}))
                    ],
                    "responses": write_errors(json!({
                        "200": ok("The run is forgotten: forgotten true, shredded true when its data key was destroyed.", "Written"),
                        "409": error_response("bad_state: the run is still going; cancel it first.")
                    }))
                }
            },
            "/v1/runs/{run_id}/resume": {
                "post": {
                    "summary": "Decide an interrupt (approve or reject)",
                    "security": security,
                    "parameters": [run_id(), idempotency_key()],
                    "requestBody": body("Resume", true),
                    "responses": write_errors(json!({
                        "200": ok("Accepted by the reducer.", "Written"),
                        "202": ok("status buffered: the interrupt is not registered yet, and the reducer keeps the decision (at most 16 per run) until it is; the final answer comes on the run's events under the same command_id.", "Written")
                    }))
                }
            },
            "/v1/runs/{run_id}/fork": {
                "post": {
                    "summary": "Start a new run from one of this run's checkpoints (time travel): completed steps keep their recorded outputs and are never run again",
                    "security": security,
                    "parameters": [run_id(), idempotency_key()],
                    "requestBody": body("Fork", true),
                    "responses": write_errors(json!({
                        "201": ok("The new run: run_id, status, forked_from {run_id, version}.", "Written"),
                        "410": error_response("run_forgotten: the run's retention passed and its payloads are gone (its checkpoints keep its shape only)."),
                        "422": error_response("fork_partition: the chosen run_id is not on the source's partition.")
                    }))
                }
            },
            "/v1/runs/{run_id}/cancel": {
                "post": {
                    "summary": "Cancel a run",
                    "security": security,
                    "parameters": [run_id(), idempotency_key()],
                    "requestBody": body("Cancel", false),
                    "responses": write_errors(json!({"200": ok("status is cancelling or cancelled.", "Written")}))
                }
            },
            "/v1/runs/{run_id}/signals/{name}": {
                "post": {
                    "summary": "Send a signal a node of the run waits for (wait: {signal: <name>})",
                    "security": security,
                    "parameters": [
                        run_id(),
                        param("name", "path", "The signal's name, as the graph's wait declares it.", json!({"type": "string", "maxLength": 64})),
                        idempotency_key()
                    ],
                    "requestBody": body("Signal", false),
                    "responses": write_errors(json!({
                        "200": ok("Taken, kept for its wait, or a duplicate of a signal id already taken.", "SignalWritten"),
                        "422": error_response("`invalid_payload`: the payload does not match the wait's schema (the message names the first place that fails).")
                    }))
                }
            },
            "/v1/signals/{name}": {
                "post": {
                    "summary": "Send a signal to the run of a graph named by its correlation label's value (no run id needed)",
                    "security": security,
                    "parameters": [
                        param("name", "path", "The signal's name, as the graph's wait declares it.", json!({"type": "string", "maxLength": 64})),
                        idempotency_key()
                    ],
                    "requestBody": body("CorrelatedSignal", true),
                    "responses": write_errors(json!({
                        "200": ok("Taken, kept for its wait, or a duplicate of a signal id already taken.", "SignalWritten"),
                        "404": error_response("`unknown_run`: no run of the graph carries that value yet (a signal is never kept for a run that does not exist: send it again later)."),
                        "422": error_response("`unknown_graph`, `no_correlation` (the graph declares no correlation label), `invalid_payload`.")
                    }))
                }
            },
            "/v1/runs/{run_id}/events": {
                "get": {
                    "summary": "A run's events in order, paged (or live SSE with Accept: text/event-stream)",
                    "security": security,
                    "parameters": [
                        run_id(),
                        param("after", "query", "Only events with seq > after.", json!({"type": "integer"})),
                        param("limit", "query", "At most this many (1-1000, default 100).", json!({"type": "integer"})),
                        min_position()
                    ],
                    "responses": read_errors(json!({"200": ok("A page of events.", "EventPage")}))
                }
            },
            "/v1/runs/{run_id}/conversation": {
                "get": {
                    "summary": "The run's agent conversations, as people read them: opening messages, model answers with their tool calls, approvals asked and decided, tool results, in order",
                    "security": security,
                    "parameters": [run_id(), min_position()],
                    "responses": read_errors(json!({"200": ok("The conversation.", "Conversation")}))
                }
            },
            "/v1/runs/{run_id}/events/stream": {
                "get": {
                    "summary": "A run's events after `after` (or Last-Event-ID), then live, as server-sent events",
                    "security": security,
                    "parameters": [
                        run_id(),
                        param("after", "query", "Start after this seq.", json!({"type": "integer"})),
                        min_position()
                    ],
                    "responses": read_errors(json!({"200": {
                        "description": "text/event-stream: `id` is the seq, `event` the event kind, `data` the event JSON.",
                        "content": {"text/event-stream": {"schema": {"type": "string"}}}
                    }}))
                }
            },
            "/v1/runs/{run_id}/checkpoints/{checkpoint_id}": {
                "get": {
                    "summary": "The run's state at a version (ckpt_<run>_<version>)",
                    "security": security,
                    "parameters": [
                        run_id(),
                        param("checkpoint_id", "path", "ckpt_<run_id>_<version>", json!({"type": "string"})),
                        min_position()
                    ],
                    "responses": read_errors(json!({
                        "200": ok("The state at that version.", "Checkpoint"),
                        "410": error_response("The view lacks part of the run's history.")
                    }))
                }
            },
            "/v1/runs/{run_id}/operations/{operation_id}/reconcile": {
                "post": {
                    "summary": "An operator records the outcome of an operation whose outcome is unknown",
                    "security": security,
                    "parameters": [
                        run_id(),
                        param("operation_id", "path", "The operation.", json!({"type": "string"})),
                        idempotency_key()
                    ],
                    "requestBody": body("Reconcile", true),
                    "responses": write_errors(json!({"200": ok("Accepted by the reducer.", "Written")}))
                }
            },
            "/v1/runs/{run_id}/operations/{operation_id}/why": {
                "get": {
                    "summary": "Why did this side effect happen? The authorization chain of one operation, each link verified: history, effect (operation id, attempts, class, arguments' SHA-256), graph (version, publisher key), approval (each approver's signed command: partition, offset, key id, proposal hash), proposal, request (the model's tool call)",
                    "security": security,
                    "parameters": [
                        run_id(),
                        param("operation_id", "path", "The operation (the receiver's Idempotency-Key).", json!({"type": "string"}))
                    ],
                    "responses": read_errors(json!({
                        "200": ok("The chain; verified is true only when every link is.", "Why"),
                        "404": error_response("unknown_run, or unknown_operation: the run dispatched no such operation."),
                        "410": error_response("run_forgotten: its arguments and proposals are gone."),
                        "503": error_response("kafka_unavailable: sortie.commands could not be read.")
                    }))
                }
            },
            "/healthz": {
                "get": {"summary": "Alive", "responses": {"200": {"description": "ok"}}}
            },
            "/readyz": {
                "get": {
                    "summary": "Ready: the view caught up with run-state and run-events as they were at start",
                    "responses": {
                        "200": {"description": "ready: {\"status\": \"ready\", \"quarantined_runs\": n}; runs the view set aside (their reads answer run_unreadable) do not make it unready"},
                        "503": error_response("not_ready: still catching up; view_failed: the view's store failed as a whole and the view stopped (restart the gateway)")
                    }
                }
            },
            "/openapi.json": {
                "get": {"summary": "This document", "responses": {"200": {"description": "OpenAPI 3.1"}}}
            }
        }
    });
    doc["components"]["schemas"]["Inbox"] = inbox_schema();
    doc["paths"]["/metrics"] = json!({
        "get": {
            "summary": "The gateway's metrics in the Prometheus text format (no token)",
            "responses": {"200": {"description": "text/plain; version=0.0.4"}}
        }
    });
    doc["paths"]["/v1/me"] = json!({
        "get": {
            "summary": "Who the bearer token speaks for: tenant, principal, roles, groups",
            "security": security,
            "responses": read_errors(json!({"200": {"description": "{\"tenant\", \"principal\", \"roles\", \"groups\"}"}}))
        }
    });
    doc["paths"]["/v1/runs/{run_id}/blobs/{sha256}"] = json!({
        "get": {
            "summary": "A large value the run references (its input, a step's output, a decision's payload stored by reference as {\"$blob\", \"sha256\", \"size\", \"media_type\"}): the stored bytes, checked against the reference's size and hash",
            "security": security,
            "parameters": [
                run_id(),
                param("sha256", "path", "The reference's sha256 (64 lower-case hex digits).", json!({"type": "string", "pattern": "^[0-9a-f]{64}$"})),
                min_position()
            ],
            "responses": read_errors(json!({
                "200": {
                    "description": "The bytes exactly as stored, as a download: Content-Disposition: attachment, Content-Security-Policy: default-src 'none'; sandbox, X-Content-Type-Options: nosniff; Content-Type application/json when the reference's media_type is JSON (Sortie's own), else application/octet-stream; ETag the hash.",
                    "content": {"application/json": {"schema": {}}, "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
                },
                "500": error_response("blob_corrupt: the stored bytes are not the referenced ones (size or hash); nothing is served."),
                "503": error_response("blob_store_unavailable: the blob store did not answer, or none is configured.")
            }))
        }
    });
    doc["paths"]["/v1/runs/{run_id}/blobs/{sha256}"]["get"]["responses"]["404"] = error_response(
        "unknown_run (also another tenant's run), unknown_blob (the run references no blob with that hash), or blob_missing (referenced, but no longer in the store).",
    );
    doc["paths"]["/ui/"] = json!({
        "get": {"summary": "The web console (HTML; signs in with a bearer token)", "responses": {"200": {"description": "text/html"}}}
    });
    doc["paths"]["/v1/inbox"] = json!({
        "get": {
            "summary": "The open approvals of the caller's tenant, with whether the caller may decide each and why not",
            "security": security,
            "parameters": [
                param("limit", "query", "At most this many (1-500, default 100), oldest first.", json!({"type": "integer"})),
                min_position()
            ],
            "responses": read_errors(json!({"200": ok("The open approvals.", "Inbox")}))
        }
    });
    doc
}

fn inbox_schema() -> Value {
    let text_or_null = json!({"type": ["string", "null"]});
    json!({
        "type": "object",
        "required": ["items"],
        "properties": {
            "truncated": {"type": "boolean", "description": "More approvals are open than `limit`."},
            "items": {"type": "array", "items": {
                "type": "object",
                "required": ["run_id", "graph_id", "tenant", "interrupt_id", "node", "proposal", "proposal_hash", "rationale", "on_reject", "opened_at", "expires_at", "may_decide", "why_not"],
                "properties": {
                    "run_id": {"type": "string"},
                    "graph_id": {"type": "string"},
                    "graph_version": {"type": "integer"},
                    "tenant": {"type": "string"},
                    "run_status": {"type": "string"},
                    "interrupt_id": {"type": "string"},
                    "node": {"type": "string"},
                    "proposal": {"type": "object", "description": "node, step_id, tool and the proposed args."},
                    "proposal_hash": {"type": "string", "description": "Pass it to /resume: a decision binds to this exact proposal."},
                    "reason": {"type": "string", "description": "Why the graph gates this node."},
                    "required_role": text_or_null,
                    "quorum": {"type": "integer"},
                    "approvals": {"type": "array", "items": {"type": "string"}},
                    "rationale": {"type": ["string", "null"], "description": "The agent's rationale: the model message that proposed the call (when an llm step requested it), else `args.rationale` of the proposal."},
                    "model_message": {"type": ["object", "null"], "description": "The model message that asked for this call: step_id (the model step), text, tool_call {id, tool, arguments}; null when no model asked for it."},
                    "affects": {"type": "object", "description": "What the step affects: node, tool, side_effect, args; edited_from and diff ({field: {from, to}}) when it replaces an edited proposal."},
                    "on_reject": {"type": ["string", "null"], "description": "What a rejection (or a refusing precheck) does, from the graph; null when this gateway does not know the graph."},
                    "precheck": text_or_null,
                    "approver_group": text_or_null,
                    "members_only": {"type": "boolean", "description": "Only members of approver_group (token groups) may decide."},
                    "opened_at": {"type": "integer", "description": "Unix ms."},
                    "expires_at": {"type": ["integer", "null"], "description": "Unix ms."},
                    "may_decide": {"type": "boolean", "description": "The reducer's rule (expiry, role, one approval per principal) applied to the caller now."},
                    "why_not": {"type": ["string", "null"], "description": "Why the caller may not decide."}
                }
            }}
        }
    })
}
