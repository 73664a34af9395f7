//! Output for people: a run's timeline (one line per event: time, node, event, detail),
//! tables, and colour only where a person looks at a terminal (stdout is a TTY and
//! `NO_COLOR` is unset or empty, <https://no-color.org>). Scripts use `--json`.

use std::collections::HashMap;
use std::io::IsTerminal as _;

use serde_json::Value;
use sortie_core::conversation::{Body, Entry};
use sortie_core::event::StepRole;
use sortie_core::{Event, EventBody, RunStatus};

/// Whether to colour what goes to stdout.
#[derive(Debug, Clone, Copy)]
pub struct Style {
    colour: bool,
}

const RESET: &str = "\x1b[0m";
const BOLD: &str = "\x1b[1m";
const DIM: &str = "\x1b[2m";
const RED: &str = "\x1b[31m";
const GREEN: &str = "\x1b[32m";
const YELLOW: &str = "\x1b[33m";
const CYAN: &str = "\x1b[36m";

impl Style {
    /// Colour when stdout is a terminal and `NO_COLOR` does not say otherwise.
    pub fn for_stdout() -> Style {
        let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
        Style {
            colour: std::io::stdout().is_terminal() && !no_color,
        }
    }

    fn paint(self, code: &str, text: &str) -> String {
        if self.colour && !code.is_empty() {
            format!("{code}{text}{RESET}")
        } else {
            text.to_owned()
        }
    }
}

/// `HH:MM:SS.mmm` (UTC) of milliseconds since the Unix epoch.
pub fn clock(ms: i64) -> String {
    let ms = ms.rem_euclid(86_400_000);
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        ms / 3_600_000,
        ms / 60_000 % 60,
        ms / 1000 % 60,
        ms % 1000
    )
}

/// `YYYY-MM-DD HH:MM:SS` (UTC), for tables.
pub fn date_time(ms: i64) -> String {
    let days = ms.div_euclid(86_400_000);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {}", &clock(ms)[..8])
}

fn status_colour(status: RunStatus) -> &'static str {
    match status {
        RunStatus::Succeeded => GREEN,
        RunStatus::Failed | RunStatus::Cancelled => RED,
        RunStatus::WaitingApproval | RunStatus::NeedsReconciliation | RunStatus::WaitingSignal => {
            YELLOW
        }
        RunStatus::Running | RunStatus::Cancelling | RunStatus::Compensating => CYAN,
    }
}

/// The colour of a status written as the API writes it (`succeeded`, ...).
pub fn paint_status(style: Style, status: &str) -> String {
    let code = match status {
        "succeeded" => GREEN,
        "failed" | "cancelled" => RED,
        "waiting_approval" | "needs_reconciliation" | "waiting_signal" => YELLOW,
        _ => CYAN,
    };
    style.paint(code, status)
}

fn compact(value: &Value, max: usize) -> String {
    let text = value.to_string();
    if text.chars().count() <= max {
        text
    } else {
        let cut: String = text.chars().take(max.saturating_sub(1)).collect();
        format!("{cut}…")
    }
}

/// Turns a run's events into timeline lines. It remembers which node each step and
/// interrupt belongs to, so results (which name only the step) show their node.
#[derive(Debug)]
pub struct Timeline {
    style: Style,
    nodes: HashMap<String, String>,
}

impl Timeline {
    pub fn new(style: Style) -> Timeline {
        Timeline {
            style,
            nodes: HashMap::new(),
        }
    }

    fn node_of(&self, id: &str) -> String {
        self.nodes.get(id).cloned().unwrap_or_else(|| {
            // Step ids are `<node>#<n>`.
            id.split('#').next().unwrap_or(id).to_owned()
        })
    }

    /// One line for `event`: time, node, event, detail.
    pub fn line(&mut self, event: &Event) -> String {
        let style = self.style;
        let (node, word, colour, detail): (String, &str, &str, String) = match &event.body {
            EventBody::CommandAccepted {
                command, duplicate, ..
            } => (
                "run".into(),
                "accepted",
                DIM,
                format!("{command}{}", if *duplicate { " (duplicate)" } else { "" }),
            ),
            EventBody::CommandRejected {
                command,
                code,
                reason,
                ..
            } => (
                "run".into(),
                "refused",
                RED,
                format!("{command}: {code}: {reason}"),
            ),
            EventBody::RunStarted {
                graph_id,
                graph_version,
                started_by,
                ..
            } => (
                "run".into(),
                "started",
                BOLD,
                format!("graph {graph_id}@{graph_version}, by {started_by}"),
            ),
            EventBody::StepDispatched {
                step_id,
                node,
                attempt,
                tool,
                side_effect,
                role,
                lookup_only,
                ..
            } => {
                self.nodes.insert(step_id.clone(), node.clone());
                let class = serde_json::to_value(side_effect)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default();
                let why = match role {
                    StepRole::Node => String::new(),
                    StepRole::Requested { by } => format!(", requested by {by}"),
                    StepRole::Compensation { of } => format!(", compensates {of}"),
                    StepRole::Substitute { for_node } => format!(", instead of {for_node}"),
                    StepRole::Precheck { of } => format!(", prechecks {of}"),
                };
                let only = if *lookup_only {
                    ", lookup only (asks the receiver, never calls)"
                } else {
                    ""
                };
                let what = match (tool.as_str(), &event.operation_id) {
                    (sortie_core::child::CHILD_TOOL, Some(op)) => format!(
                        "child run {}",
                        sortie_core::child::child_run_id(
                            &event.tenant,
                            &event.run_id,
                            op,
                            *attempt
                        )
                    ),
                    _ => format!("{class}, {tool}"),
                };
                (
                    node.clone(),
                    "dispatched",
                    "",
                    format!("attempt {attempt}, {what}{why}{only}"),
                )
            }
            EventBody::StepStarted { step_id, attempt } => (
                self.node_of(step_id),
                "calling",
                DIM,
                format!("attempt {attempt}"),
            ),
            EventBody::StepSucceeded {
                step_id, attempt, ..
            } => (
                self.node_of(step_id),
                "succeeded",
                GREEN,
                format!("attempt {attempt}"),
            ),
            EventBody::StepFailed {
                step_id,
                attempt,
                code,
                message,
                retryable,
                retry_at,
            } => (
                self.node_of(step_id),
                "failed",
                if *retryable { YELLOW } else { RED },
                format!(
                    "attempt {attempt}, {code}: {message}{}",
                    match retry_at {
                        Some(at) => format!("; retry at {}", clock(*at)),
                        None if *retryable => "; retryable".into(),
                        None => "; final".into(),
                    }
                ),
            ),
            EventBody::StepOutcomeUnknown {
                step_id,
                attempt,
                message,
                needs_operator,
            } => (
                self.node_of(step_id),
                "unknown",
                YELLOW,
                format!(
                    "attempt {attempt}, {message}{}",
                    if *needs_operator {
                        "; needs an operator"
                    } else {
                        ""
                    }
                ),
            ),
            EventBody::OperationReconciled {
                step_id,
                succeeded,
                error,
                by,
                ..
            } => (
                self.node_of(step_id),
                "reconciled",
                if *succeeded { GREEN } else { RED },
                format!(
                    "{} by {by}{}",
                    if *succeeded { "succeeded" } else { "failed" },
                    error
                        .as_deref()
                        .map(|e| format!(": {e}"))
                        .unwrap_or_default()
                ),
            ),
            EventBody::Interrupted {
                interrupt_id,
                node,
                proposal,
                reason,
                required_role,
                ..
            } => {
                self.nodes.insert(interrupt_id.clone(), node.clone());
                (
                    node.clone(),
                    "waiting",
                    YELLOW,
                    format!(
                        "approval {interrupt_id}{}: {reason} proposal {}",
                        required_role
                            .as_deref()
                            .map(|r| format!(" (role {r})"))
                            .unwrap_or_default(),
                        compact(proposal, 80)
                    ),
                )
            }
            EventBody::InterruptDecided {
                interrupt_id,
                approve,
                decided_by,
                comment,
                is_final,
                ..
            } => (
                self.node_of(interrupt_id),
                if *approve { "approved" } else { "rejected" },
                if *approve { GREEN } else { RED },
                format!(
                    "by {decided_by}{}{}",
                    if *is_final {
                        ""
                    } else {
                        " (more approvals needed)"
                    },
                    comment
                        .as_deref()
                        .map(|c| format!(": {c}"))
                        .unwrap_or_default()
                ),
            ),
            EventBody::InterruptEscalated {
                interrupt_id,
                approver_group,
                expires_at,
            } => (
                self.node_of(interrupt_id),
                "escalated",
                YELLOW,
                format!("to {approver_group}, until {}", clock(*expires_at)),
            ),
            EventBody::InterruptExpired {
                interrupt_id,
                on_timeout,
            } => (
                self.node_of(interrupt_id),
                "expired",
                RED,
                format!("on_timeout: {on_timeout}"),
            ),
            EventBody::CancelRequested {
                requested_by,
                reason,
            } => (
                "run".into(),
                "cancel",
                YELLOW,
                format!(
                    "by {requested_by}{}",
                    reason
                        .as_deref()
                        .map(|r| format!(": {r}"))
                        .unwrap_or_default()
                ),
            ),
            EventBody::RunStatusChanged { status, reason, .. } => (
                "run".into(),
                status.as_str(),
                status_colour(*status),
                reason.clone().unwrap_or_default(),
            ),
            EventBody::DecisionBuffered {
                interrupt_id,
                approve,
                decided_by,
                ..
            } => (
                self.node_of(interrupt_id),
                "buffered",
                DIM,
                format!(
                    "{} by {decided_by}, before the interrupt opened",
                    if *approve { "approval" } else { "rejection" }
                ),
            ),
            EventBody::RunForgotten { reason } => (
                "run".into(),
                "forgotten",
                DIM,
                format!("payloads dropped ({reason})"),
            ),
            EventBody::SignalWaitOpened {
                step_id,
                node,
                signal,
                many,
                wanted,
                expires_at,
            } => {
                self.nodes.insert(step_id.clone(), node.clone());
                let what = if *many {
                    format!("{wanted} × signal {signal}")
                } else {
                    format!("signal {signal}")
                };
                (
                    node.clone(),
                    "waiting",
                    YELLOW,
                    format!(
                        "for {what}{}",
                        expires_at
                            .map(|t| format!(", until {}", date_time(t)))
                            .unwrap_or_default()
                    ),
                )
            }
            EventBody::SignalReceived {
                step_id,
                signal,
                signal_id,
                payload,
                sent_by,
            } => (
                self.node_of(step_id),
                "signal",
                GREEN,
                format!(
                    "{signal} {signal_id} from {sent_by} {}",
                    compact(payload, 60)
                ),
            ),
            EventBody::SignalBuffered {
                signal,
                signal_id,
                sent_by,
                ..
            } => (
                "run".into(),
                "kept",
                DIM,
                format!("{signal} {signal_id} from {sent_by}, before its wait opened"),
            ),
            EventBody::SignalWaitExpired {
                step_id,
                on_timeout,
            } => (
                self.node_of(step_id),
                "expired",
                RED,
                format!("no signal before the deadline ({on_timeout})"),
            ),
            EventBody::BudgetReserved {
                step_id,
                child_run_id,
                limits,
            } => (
                self.node_of(step_id),
                "reserved",
                DIM,
                format!(
                    "for child {child_run_id}: {}",
                    serde_json::to_string(limits).unwrap_or_default()
                ),
            ),
            EventBody::BudgetSettled { step_id, spent } => (
                self.node_of(step_id),
                "settled",
                DIM,
                format!(
                    "the child spent {} tokens, ${:.4}, {} tool calls",
                    spent.tokens(),
                    spent.cost_usd,
                    spent.tool_calls
                ),
            ),
        };
        let line = format!(
            "{}  {:<18} {} {}",
            style.paint(DIM, &clock(event.at)),
            node,
            style.paint(colour, &format!("{word:<11}")),
            detail
        );
        line.trim_end().to_owned()
    }
}

/// A table: a header row and rows, columns padded to their widest cell.
pub fn table(style: Style, header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(visible_len(cell));
            }
        }
    }
    let mut out = String::new();
    let head: Vec<String> = header
        .iter()
        .enumerate()
        .map(|(i, h)| format!("{h:<w$}", w = widths[i]))
        .collect();
    out.push_str(style.paint(BOLD, head.join("  ").trim_end()).as_str());
    out.push('\n');
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(i, cell)| {
                let pad = widths
                    .get(i)
                    .copied()
                    .unwrap_or(0)
                    .saturating_sub(visible_len(cell));
                format!("{cell}{}", " ".repeat(pad))
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// A cell's width on screen: ANSI colour sequences take none.
fn visible_len(text: &str) -> usize {
    let mut len = 0;
    let mut in_escape = false;
    for c in text.chars() {
        match (in_escape, c) {
            (false, '\x1b') => in_escape = true,
            (true, 'm') => in_escape = false,
            (true, _) => {}
            (false, _) => len += 1,
        }
    }
    len
}

/// One entry of a run's conversation (`run get|watch --conversation`): time, who speaks,
/// then what was said, the tool calls asked for, an approval or a result, indented when
/// it runs over several lines.
pub fn conversation_line(style: Style, entry: &Entry) -> String {
    let time = style.paint(DIM, &clock(entry.at));
    let (who, colour, text) = match &entry.body {
        Body::Message { role, text } => (role.clone(), BOLD, text.clone()),
        Body::Model {
            text, tool_calls, ..
        } => {
            let mut lines: Vec<String> = text.iter().cloned().collect();
            for call in tool_calls {
                lines.push(format!(
                    "→ {}({}){}",
                    call.tool,
                    compact(&call.arguments, 200),
                    call.id
                        .as_deref()
                        .map(|id| format!("  [{id}]"))
                        .unwrap_or_default()
                ));
            }
            ("model".to_owned(), CYAN, lines.join("\n"))
        }
        Body::Approval {
            tool,
            state,
            by,
            comment,
            ..
        } => {
            let mut text = format!("{tool}: {state}");
            if let Some(by) = by {
                text.push_str(&format!(" by {by}"));
            }
            if let Some(comment) = comment {
                text.push_str(&format!(" — “{comment}”"));
            }
            let colour = match state.as_str() {
                "approved" => GREEN,
                "rejected" | "expired" => RED,
                _ => YELLOW,
            };
            ("approval".to_owned(), colour, text)
        }
        Body::ToolResult {
            tool, status, text, ..
        } => {
            let colour = if status.starts_with("succeeded") {
                GREEN
            } else if status.starts_with("failed") {
                RED
            } else {
                YELLOW
            };
            (format!("tool {tool}"), colour, format!("[{status}] {text}"))
        }
    };
    let indent = " ".repeat(12 + 2 + 18 + 1);
    let text = text.replace('\n', &format!("\n{indent}"));
    format!("{time}  {:<18} {}", style.paint(colour, &who), text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: i64, body: EventBody) -> Event {
        Event {
            tenant: "t".into(),
            run_id: "run_1".into(),
            seq,
            state_version: seq,
            at: 1_796_054_645_123,
            command_id: None,
            operation_id: None,
            prev_hash: None,
            hash: None,
            body,
        }
    }

    #[test]
    fn a_conversation_prints_who_speaks_the_calls_and_the_results() {
        use sortie_core::conversation::{Body, Entry, ToolCall};
        let style = Style { colour: false };
        let entry = |body| Entry {
            seq: 1,
            at: 1_796_054_645_123,
            node: "assistant".into(),
            body,
        };
        let model = conversation_line(
            style,
            &entry(Body::Model {
                step_id: "assistant#1".into(),
                text: Some("Let me look.".into()),
                tool_calls: vec![ToolCall {
                    id: Some("toolu_1".into()),
                    tool: "lookup_order".into(),
                    arguments: serde_json::json!({"order_id": "7"}),
                }],
                model: None,
                usage: None,
            }),
        );
        assert!(model.starts_with("16:04:05.123  model"), "{model}");
        assert!(model.contains("Let me look.\n"), "{model}");
        assert!(
            model.ends_with(r#"→ lookup_order({"order_id":"7"})  [toolu_1]"#),
            "{model}"
        );
        let approval = conversation_line(
            style,
            &entry(Body::Approval {
                call_id: None,
                tool: "refund".into(),
                step_id: "refund#1".into(),
                interrupt_id: "int_1".into(),
                state: "approved".into(),
                by: Some("alice".into()),
                comment: Some("ok".into()),
            }),
        );
        assert!(
            approval.ends_with("refund: approved by alice — “ok”"),
            "{approval}"
        );
        let result = conversation_line(
            style,
            &entry(Body::ToolResult {
                call_id: None,
                tool: "refund".into(),
                step_id: "refund#1".into(),
                status: "succeeded".into(),
                text: "Refunded 30.".into(),
            }),
        );
        assert!(result.contains("tool refund"), "{result}");
        assert!(result.ends_with("[succeeded] Refunded 30."), "{result}");
        assert!(!result.contains('\x1b'), "no colour");
    }

    #[test]
    fn lines_name_the_node_of_every_step_and_stay_plain_without_colour() {
        let mut timeline = Timeline::new(Style { colour: false });
        let dispatched = timeline.line(&event(
            1,
            EventBody::StepDispatched {
                step_id: "read_order#1".into(),
                node: "read_order".into(),
                attempt: 1,
                tool: "http".into(),
                queue: "http".into(),
                side_effect: sortie_core::SideEffect::Pure,
                args: Value::Null,
                role: StepRole::Node,
                timeout_at: None,
                lookup_only: false,
            },
        ));
        assert_eq!(
            dispatched,
            "16:04:05.123  read_order         dispatched  attempt 1, pure, http"
        );
        let failed = timeline.line(&event(
            2,
            EventBody::StepFailed {
                step_id: "read_order#1".into(),
                attempt: 1,
                code: "http_503".into(),
                message: "busy".into(),
                retryable: true,
                retry_at: None,
            },
        ));
        assert!(
            failed.contains("read_order         failed      attempt 1, http_503: busy; retryable"),
            "{failed}"
        );
        let done = timeline.line(&event(
            3,
            EventBody::RunStatusChanged {
                status: RunStatus::Succeeded,
                reason: None,
                output: None,
                forget_at: None,
            },
        ));
        assert!(done.ends_with("run                succeeded"), "{done:?}");
        assert!(!done.contains('\x1b'));
    }

    #[test]
    fn colour_wraps_the_event_word_and_tables_pad_around_it() {
        let style = Style { colour: true };
        let mut timeline = Timeline::new(style);
        let line = timeline.line(&event(
            1,
            EventBody::RunStatusChanged {
                status: RunStatus::Failed,
                reason: Some("boom".into()),
                output: None,
                forget_at: None,
            },
        ));
        assert!(line.contains("\x1b[31mfailed"), "{line:?}");
        let table = table(
            style,
            &["RUN", "STATUS"],
            &[vec!["r1".into(), paint_status(style, "failed")]],
        );
        assert_eq!(table.lines().nth(1), Some("r1   \x1b[31mfailed\x1b[0m"));
    }

    #[test]
    fn dates_are_civil_utc() {
        assert_eq!(date_time(0), "1970-01-01 00:00:00");
        assert_eq!(date_time(1_796_054_645_123), "2026-11-30 16:04:05");
    }
}
