//! Why did this side effect happen? (SPEC §12, issue #36 item 6.) The authorization chain
//! of one operation, each link verified, not just displayed:
//!
//! 1. **history** — the run's events: gap-free seq and an intact hash chain (over their
//!    sealed form), so every link below reads what was written;
//! 2. **effect** — the operation in the receiver's terms (operation id, attempts, class)
//!    and the step it is: the operation id must be the one derived from the step, the
//!    tool and the exact arguments (their hash is shown);
//! 3. **graph** — the graph version the run pinned, as the graph table read it with a
//!    keyring: the publisher key that signed it, its definition hash, and the node's class;
//! 4. **approval** — where the graph gates the node: every approval that released the
//!    step, each bound to the proposal hash, each carried by a command on
//!    `sortie.commands` whose signature verifies against the keyring and whose fields are
//!    the decision's (partition, offset, key id); the gate's rules (quorum, required
//!    role, members-only group) taken from the signed graph version, never from the
//!    history; an approval counted only when its signed command's roles and groups meet
//!    them and the fold accepted it; and the dispatched arguments must be the ones
//!    approved (the `approval` module);
//! 5. **proposal** — what the approvers saw, its hash recomputed;
//! 6. **request** — for a step an agent asked for, the model's answer (the asking step's
//!    output, its hash) and the tool call in it that names this node with these
//!    arguments;
//! 7. **child** — for an operation that starts a child run (tool `$run`), the child run
//!    each attempt started, its id derived, to follow the chain downward;
//! 8. **parent** — for any operation of a child run, the parent's run, step, operation
//!    and attempt that started the child: the child's id derived from them, its start
//!    issued as the parent and signed, and (given the parent's history,
//!    [`Chain::check_parent`]) the parent's dispatch of that operation as a child run;
//!    with the command that follows the chain upward (`sortie audit why <op> --run
//!    <parent>`). See [`family`].
//!
//! A link is `verified`, `broken` (named, with why) or `unchecked` (the proof is not at
//! hand: sealed arguments without the run's keys, no keyring, a command past the topic's
//! retention). The chain holds only when every link is verified.
//!
//! This crate builds the chain from what its caller reads ([`why`] does no I/O; the
//! commands are looked up through [`Commands`], [`KafkaCommands`] on the real topic).
//! The CLI (`sortie audit why`) reads the history from Kafka; the gateway
//! (`GET /v1/runs/{id}/operations/{op}/why`) from its view.

use serde::Serialize;
use serde_json::{json, Value};
use sortie_catalog::Publication;
use sortie_core::event::StepRole;
use sortie_core::state::RunState;
use sortie_core::{ids, json as j, Event, EventBody, Graph, Seal};
use sortie_wire::records as w;
use sortie_wire::signing::{Claim, Keyring};

mod approval;
pub mod family;
mod kafka;

pub use family::{follow_child, follow_parent};
pub use kafka::KafkaCommands;

/// How one link stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Verified,
    /// Something does not hold: the chain is broken here.
    Broken,
    /// The proof is not at hand (named in the link's problem).
    Unchecked,
}

/// One link of the chain.
#[derive(Debug, Clone, Serialize)]
pub struct Link {
    pub link: &'static str,
    pub status: Status,
    /// What the link is about, as read and recomputed.
    pub facts: Value,
    /// Why the link is broken or unchecked.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
}

/// The authorization chain of one operation.
#[derive(Debug, Clone, Serialize)]
pub struct Chain {
    pub operation_id: String,
    pub run_id: String,
    pub tenant: String,
    /// Every link verified.
    pub verified: bool,
    pub links: Vec<Link>,
    /// For a chain in a child run: what its `parent` link holds before the parent's
    /// history is given ([`Chain::check_parent`]).
    #[serde(skip)]
    parent: Option<family::ParentCheck>,
}

impl Chain {
    /// The parent's run, step, operation and attempt that started this chain's run, for
    /// a child run: the run whose history [`Chain::check_parent`] takes.
    pub fn parent(&self) -> Option<&sortie_core::child::ParentLink> {
        self.parent.as_ref().map(|p| &p.parent)
    }

    /// Completes the `parent` link with the parent run's history as the caller read it
    /// (in order; an empty one when the parent run has none there): the parent must have
    /// dispatched the operation, at the attempt, as the step that started this child run,
    /// to tool `$run`. Without it the link stays `unchecked`. Pure, as [`why`].
    pub fn check_parent(&mut self, parent_history: &[Event]) {
        let Some(check) = &self.parent else { return };
        let checked = family::parent_link(check, Some(parent_history));
        for link in &mut self.links {
            if link.link == "parent" {
                *link = checked.clone();
            }
        }
        self.verified = self.links.iter().all(|l| l.status == Status::Verified);
    }
}

/// A command record found on `sortie.commands`.
#[derive(Debug, Clone)]
pub struct CommandRecord {
    pub partition: i32,
    pub offset: i64,
    /// The value bytes exactly as produced (what a signature covers).
    pub value: Vec<u8>,
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    pub command: w::RunCommand,
}

/// Where the command that carried a decision is.
#[derive(Debug, Clone)]
pub enum Found {
    Record(Box<CommandRecord>),
    /// Not on the topic any more: its retention passed.
    Gone,
    /// Not there although the topic still holds that time.
    Missing,
    /// The topic could not be read.
    Unreadable(String),
}

/// Looks commands up on `sortie.commands`.
pub trait Commands {
    /// The record of `command_id` for `run_id`, appended by the broker at `at` (the
    /// topic is `LogAppendTime`, and the fold's clock is that time).
    fn find(&mut self, run_id: &str, command_id: &str, at: i64) -> Found;
}

/// What [`why`] reads.
#[allow(missing_debug_implementations)]
pub struct Inputs<'a> {
    pub operation_id: &'a str,
    /// The run's history in order: as written, or opened (then `seal` is the run's, and
    /// each event is sealed again to check its hash).
    pub history: &'a [Event],
    pub seal: &'a dyn Seal,
    /// The payloads in `history` are readable (opened, or never sealed).
    pub readable: bool,
    /// The run's graph version, as a table trusting `keyring` read it.
    pub graph: Option<&'a Graph>,
    pub publication: Option<&'a Publication>,
    /// The keyring commands and graphs are checked against.
    pub keyring: Option<&'a Keyring>,
    pub commands: &'a mut dyn Commands,
}

fn sha(value: &Value) -> String {
    j::sha256_hex(&[&j::canonical(value)])
}

fn link(name: &'static str, facts: Value, problems: Vec<String>, unchecked: Vec<String>) -> Link {
    let status = if !problems.is_empty() {
        Status::Broken
    } else if !unchecked.is_empty() {
        Status::Unchecked
    } else {
        Status::Verified
    };
    let mut all = problems;
    all.extend(unchecked);
    Link {
        link: name,
        status,
        facts,
        problems: all,
    }
}

const SEALED_ARGS: &str = "the arguments are sealed: give the run keys to check them";

/// The plain parts of [`Inputs`].
struct Parts<'a> {
    operation_id: &'a str,
    readable: bool,
    graph: Option<&'a Graph>,
    publication: Option<&'a Publication>,
    keyring: Option<&'a Keyring>,
}

/// The chain of `inputs.operation_id` in `inputs.history`.
pub fn why(inputs: Inputs<'_>) -> Chain {
    let Inputs {
        operation_id,
        history,
        seal,
        readable,
        graph,
        publication,
        keyring,
        commands,
    } = inputs;
    let inputs = Parts {
        operation_id,
        readable,
        graph,
        publication,
        keyring,
    };
    let (tenant, run_id) = history
        .first()
        .map(|e| (e.tenant.clone(), e.run_id.clone()))
        .unwrap_or_default();
    let mut chain = Chain {
        operation_id: inputs.operation_id.to_owned(),
        run_id: run_id.clone(),
        tenant: tenant.clone(),
        verified: false,
        links: Vec::new(),
        parent: None,
    };
    chain.links.push(history_link(history, seal));
    let state = history.iter().fold(None, sortie_core::evolve);
    let dispatches: Vec<&Event> = history
        .iter()
        .filter(|e| {
            e.operation_id.as_deref() == Some(inputs.operation_id)
                && matches!(e.body, EventBody::StepDispatched { .. })
        })
        .collect();
    let (Some(state), Some(first)) = (state, dispatches.first()) else {
        chain.links.push(link(
            "effect",
            json!({"operation_id": inputs.operation_id, "run_id": run_id}),
            vec![format!(
                "no step of run {run_id} dispatched operation {}",
                inputs.operation_id
            )],
            vec![],
        ));
        return finish(chain);
    };
    let EventBody::StepDispatched {
        step_id,
        node,
        tool,
        side_effect,
        args,
        role,
        ..
    } = &first.body
    else {
        unreachable!("filtered on StepDispatched")
    };

    // The effect and its step.
    let attempts: Vec<Value> = dispatches
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::StepDispatched {
                attempt,
                lookup_only,
                ..
            } => Some(json!({"attempt": attempt, "at": e.at, "lookup_only": lookup_only})),
            _ => None,
        })
        .collect();
    let outcome = state.steps.get(step_id).map(|s| s.status);
    let (mut problems, mut unchecked) = (Vec::new(), Vec::new());
    let args_hash = if inputs.readable {
        let derived = ids::operation_id(&tenant, &run_id, step_id, tool, args);
        if derived != inputs.operation_id {
            problems.push(format!(
                "the operation id is not the one its step, tool and arguments derive ({derived})"
            ));
        }
        Some(sha(args))
    } else {
        unchecked.push(SEALED_ARGS.to_owned());
        None
    };
    chain.links.push(link(
        "effect",
        json!({
            "operation_id": inputs.operation_id,
            "attempts": attempts,
            "class": side_effect,
            "tool": tool,
            "step_id": step_id,
            "node": node,
            "role": role,
            "args_sha256": args_hash,
            "outcome": outcome,
        }),
        problems,
        unchecked,
    ));

    // The graph version.
    let graph_key = format!("{}@{}", state.graph_id, state.graph_version);
    // The child runs a `$run` operation started: the chain downward.
    if tool == sortie_core::child::CHILD_TOOL {
        let started = family::Started {
            tenant: &tenant,
            run_id: &run_id,
            operation_id: inputs.operation_id,
            node,
            attempts: dispatches
                .iter()
                .filter_map(|e| match &e.body {
                    EventBody::StepDispatched { attempt, .. } => Some(*attempt),
                    _ => None,
                })
                .collect(),
        };
        chain
            .links
            .push(family::child_link(&started, inputs.graph, &graph_key));
    }
    let graph_node = inputs.graph.and_then(|g| g.node(node));
    let (mut problems, mut unchecked) = (Vec::new(), Vec::new());
    match (inputs.graph, graph_node) {
        (None, _) => problems.push(format!(
            "graph {graph_key} is not in the graph table (never published, or refused: unsigned or forged)"
        )),
        (Some(_), None) => problems.push(format!("graph {graph_key} has no node {node}")),
        (Some(_), Some(n)) if n.side_effect != *side_effect => problems.push(format!(
            "dispatched as {side_effect:?}, but the graph's class of {node} is {:?}",
            n.side_effect
        )),
        _ => {}
    }
    let signed_by = inputs.publication.and_then(|p| p.signed_by.clone());
    match (inputs.keyring, &signed_by) {
        (None, _) => unchecked.push("no keyring: the publisher's signature is not checked".into()),
        (Some(_), None) if inputs.graph.is_some() => problems.push(format!(
            "graph {graph_key} is not signed by a publisher key of the keyring"
        )),
        _ => {}
    }
    chain.links.push(link(
        "graph",
        json!({
            "graph": graph_key,
            "definition_sha256": inputs.publication.map(|p| &p.definition_hash),
            "published_by": inputs.publication.map(|p| &p.published_by),
            "published_at": inputs.publication.map(|p| p.published_at),
            "signed_by": signed_by,
            "gated": graph_node.map(|n| n.interrupt_before.is_some()),
        }),
        problems,
        unchecked,
    ));

    // The approvals.
    let gated = graph_node.is_some_and(|n| n.interrupt_before.is_some())
        && !matches!(
            role,
            StepRole::Compensation { .. } | StepRole::Precheck { .. }
        );
    let rules = graph_node.and_then(|n| n.interrupt_before.as_ref());
    if let (true, Some(graph_node), Some(rules)) = (gated, graph_node, rules) {
        let gate = approval::Gate {
            node: graph_node,
            rules,
            graph_key: &graph_key,
            step_id,
            role,
            args,
        };
        let seen = approval::Seen {
            state: &state,
            history,
            readable,
            keyring,
        };
        chain.links.extend(approval::links(&gate, &seen, commands));
    } else {
        chain.links.push(link(
            "approval",
            json!({
                "gated": false,
                "why": match role {
                    StepRole::Compensation { .. } => "a compensation is never gated".to_owned(),
                    StepRole::Precheck { .. } => "a precheck runs after its call's approval".to_owned(),
                    _ => format!("node {node} has no interrupt_before in {graph_key}"),
                },
            }),
            vec![],
            vec![],
        ));
    }

    // The model's request.
    if let StepRole::Requested { by } = role {
        chain.links.push(request_link(
            &state,
            history,
            inputs.readable,
            Asked {
                by,
                node,
                step_id,
                args,
            },
        ));
    }

    // The parent step that started this run, for a child: the chain upward.
    chain.parent = family::parent_check(history, inputs.keyring, commands);
    if let Some(check) = &chain.parent {
        chain.links.push(family::parent_link(check, None));
    }
    finish(chain)
}

fn finish(mut chain: Chain) -> Chain {
    chain.verified = chain.links.iter().all(|l| l.status == Status::Verified);
    chain
}

fn history_link(history: &[Event], seal: &dyn Seal) -> Link {
    let mut problems = Vec::new();
    let mut prev: Option<String> = None;
    for (i, event) in history.iter().enumerate() {
        let seq = i as i64 + 1;
        if event.seq != seq {
            problems.push(format!(
                "event {seq} has seq {}: the history has a gap or a duplicate",
                event.seq
            ));
            break;
        }
        if event.prev_hash != prev {
            problems.push(format!(
                "seq {seq}: prev_hash does not match the previous event's hash"
            ));
            break;
        }
        let mut hash = event.sealed(seal).compute_hash();
        if event.hash.as_deref() != Some(hash.as_str()) && seal.active() {
            hash = event.sealed_before_texts(seal).compute_hash();
        }
        if event.hash.as_deref() != Some(hash.as_str()) {
            problems.push(format!(
                "seq {seq}: its hash does not match its content (altered history)"
            ));
            break;
        }
        prev = event.hash.clone();
    }
    link(
        "history",
        json!({"events": history.len(), "head": prev}),
        problems,
        vec![],
    )
}

/// What the command behind an event of the history must say.
pub(crate) struct Expected<'a> {
    pub(crate) tenant: &'a str,
    /// Its issuer.
    pub(crate) principal: &'a str,
    /// What the history names (`decision`, `start`) and what the command did (`decided`,
    /// `started`), for the problems.
    pub(crate) noun: &'a str,
    pub(crate) verb: &'a str,
    /// Whether its body is the one the history says.
    pub(crate) says: &'a dyn Fn(&w::CommandBody) -> bool,
}

pub(crate) enum Signature {
    Verified(String),
    Broken(String),
    Unchecked(String),
}

impl Signature {
    /// The signature's facts: the key that signed it, and how it stands.
    pub(crate) fn facts(&self) -> (Option<&str>, &'static str) {
        match self {
            Signature::Verified(key) => (Some(key.as_str()), "verified"),
            Signature::Broken(_) => (None, "broken"),
            Signature::Unchecked(_) => (None, "unchecked"),
        }
    }
}

/// Finds the command behind an event of the history (a decision, a child's start) and
/// checks it says what the history says and that its signature holds. Also answers who
/// the command found says sent it (what its signature covers when it holds).
pub(crate) fn signed_command(
    commands: &mut dyn Commands,
    keyring: Option<&Keyring>,
    run_id: &str,
    command_id: &str,
    at: i64,
    expected: Expected<'_>,
) -> (Signature, Value, Option<w::Issuer>) {
    let record = match commands.find(run_id, command_id, at) {
        Found::Record(record) => record,
        Found::Gone => {
            return (
                Signature::Unchecked(format!(
                    "command {command_id} is past the retention of sortie.commands"
                )),
                Value::Null,
                None,
            )
        }
        Found::Missing => {
            return (
                Signature::Broken(format!(
                    "no command {command_id} on sortie.commands carries it (the history names a {} nobody sent)",
                    expected.noun
                )),
                Value::Null,
                None,
            )
        }
        Found::Unreadable(why) => {
            return (
                Signature::Unchecked(format!("sortie.commands could not be read: {why}")),
                Value::Null,
                None,
            )
        }
    };
    let facts = json!({"partition": record.partition, "offset": record.offset});
    let command = &record.command;
    let issuer = Some(command.issuer.clone());
    if !(expected.says)(&command.body)
        || command.issuer.principal != expected.principal
        || command.tenant != expected.tenant
        || command.run_id != run_id
    {
        return (
            Signature::Broken(format!(
                "command {command_id} at offset {} does not say what the history says it {}",
                record.offset, expected.verb
            )),
            facts,
            issuer,
        );
    }
    let Some(keyring) = keyring else {
        return (
            Signature::Unchecked("no keyring: the signature is not checked".into()),
            facts,
            issuer,
        );
    };
    let claim = Claim {
        tenant: &command.tenant,
        principal: &command.issuer.principal,
        roles: &command.issuer.roles,
        groups: &command.issuer.groups,
    };
    let headers = record
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_deref()));
    let signature = match keyring.check(headers, &record.value, claim) {
        Ok(Some(key)) => Signature::Verified(key),
        Ok(None) => Signature::Broken(format!("command {command_id} is not signed")),
        Err(why) => Signature::Broken(format!("command {command_id}: {why}")),
    };
    (signature, facts, issuer)
}

/// A step an agent asked for.
struct Asked<'a> {
    by: &'a str,
    node: &'a str,
    step_id: &'a str,
    args: &'a Value,
}

/// The link from a step an agent asked for to the model's answer that asked for it.
fn request_link(state: &RunState, history: &[Event], readable: bool, asked: Asked<'_>) -> Link {
    let Asked {
        by,
        node,
        step_id,
        args,
    } = asked;
    let asking = state.steps.get(by);
    let output = asking.and_then(|s| s.output.as_ref());
    let mut facts = json!({
        "requested_by": by,
        "operation_id": asking.map(|s| &s.operation_id),
        "tool": asking.map(|s| &s.tool),
        "model": output.and_then(|o| o.get("model")),
        "output_sha256": readable.then(|| output.map(sha)).flatten(),
    });
    if !readable {
        return link(
            "request",
            facts,
            vec![],
            vec!["the model's answer is sealed: give the run keys to check it".into()],
        );
    }
    let Some(output) = output else {
        return link(
            "request",
            facts,
            vec![format!(
                "step {by}, which asked for {step_id}, has no recorded answer"
            )],
            vec![],
        );
    };
    // What the model asked for: the first proposal's arguments for a gated step (an
    // approver may have edited them since), else the dispatched ones.
    let requested = history.iter().find_map(|e| match &e.body {
        EventBody::Interrupted {
            step_id: id,
            proposal,
            ..
        } if id == step_id => proposal.get("args").cloned(),
        _ => None,
    });
    let candidates: Vec<Value> = requested.into_iter().chain([args.clone()]).collect();
    let call = output
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find(|call| {
            let function = &call["function"];
            let arguments = match &function["arguments"] {
                Value::String(text) => serde_json::from_str(text).unwrap_or(Value::Null),
                other => other.clone(),
            };
            function["name"] == node && candidates.contains(&arguments)
        })
        .cloned();
    let next_step = output
        .get("next_steps")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find(|s| s["node"] == node && candidates.contains(&s["args"]))
        .cloned();
    facts["tool_call"] = call.clone().or(next_step.clone()).unwrap_or(Value::Null);
    let problems = match (call, next_step) {
        (None, None) => vec![format!(
            "the answer of step {by} holds no call of {node} with these arguments"
        )],
        _ => vec![],
    };
    link("request", facts, problems, vec![])
}

/// The chain as people read it: one line per link.
pub fn render(chain: &Chain) -> String {
    use std::fmt::Write as _;
    let mut out = format!(
        "why {} (run {}, tenant {})\n",
        chain.operation_id, chain.run_id, chain.tenant
    );
    for link in &chain.links {
        let mark = match link.status {
            Status::Verified => "ok",
            Status::Broken => "BROKEN",
            Status::Unchecked => "unchecked",
        };
        let _ = writeln!(out, "  {:<9} {:<10} {}", link.link, mark, summary(link));
        for problem in &link.problems {
            let _ = writeln!(out, "  {:<9} {:<10}   - {problem}", "", "");
        }
    }
    let _ = writeln!(
        out,
        "{}",
        if chain.verified {
            "every link holds"
        } else {
            "the chain does not hold"
        }
    );
    out
}

fn summary(link: &Link) -> String {
    let f = &link.facts;
    let s = |v: &Value| match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    };
    match link.link {
        "history" => format!("{} events, head {}", s(&f["events"]), s(&f["head"])),
        "effect" => format!(
            "{} {} ({}, tool {}), {} attempt(s), args sha256 {}, {}",
            s(&f["operation_id"]),
            s(&f["step_id"]),
            s(&f["class"]),
            s(&f["tool"]),
            f["attempts"].as_array().map_or(0, Vec::len),
            s(&f["args_sha256"]),
            s(&f["outcome"])
        ),
        "graph" => format!(
            "{} published by {}, signed by key {}, definition sha256 {}",
            s(&f["graph"]),
            s(&f["published_by"]),
            s(&f["signed_by"]),
            s(&f["definition_sha256"])
        ),
        "approval" if f["gated"] == false => s(&f["why"]),
        "approval" => {
            let approvals: Vec<String> = f["approvals"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|a| {
                    format!(
                        "{} (key {}, sortie.commands[{}]@{}, signature {}{})",
                        s(&a["principal"]),
                        s(&a["key_id"]),
                        s(&a["record"]["partition"]),
                        s(&a["record"]["offset"]),
                        s(&a["signature"]),
                        if a["counted"] == true {
                            ""
                        } else {
                            ", not counted"
                        }
                    )
                })
                .collect();
            format!(
                "{}: {} counted of quorum {} (gate of {}): {}",
                s(&f["interrupt_id"]),
                s(&f["counted"]),
                s(&f["quorum"]),
                s(&f["rules_from"]),
                approvals.join("; ")
            )
        }
        "proposal" => format!(
            "{} {} args sha256 {}, hash {}",
            s(&f["node"]),
            s(&f["tool"]),
            s(&f["args_sha256"]),
            s(&f["proposal_hash"])
        ),
        "request" => format!(
            "asked by {} ({}, model {}), answer sha256 {}, call {}",
            s(&f["requested_by"]),
            s(&f["operation_id"]),
            s(&f["model"]),
            s(&f["output_sha256"]),
            s(&f["tool_call"]["id"])
        ),
        "child" => {
            let runs: Vec<String> = f["runs"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| format!("{} (attempt {})", s(&r["run_id"]), s(&r["attempt"])))
                .collect();
            let follow = f["runs"]
                .as_array()
                .and_then(|r| r.last())
                .map_or_else(|| "-".to_owned(), |r| s(&r["follow"]));
            format!(
                "started child run {} of graph {}; follow: {follow}",
                runs.join(", "),
                s(&f["graph"])
            )
        }
        "parent" => format!(
            "a child of run {}, step {} ({} attempt {}), started by {} (signature {}); follow: {}",
            s(&f["run_id"]),
            s(&f["step_id"]),
            s(&f["operation_id"]),
            s(&f["attempt"]),
            s(&f["started_by"]),
            s(&f["start_command"]["signature"]),
            s(&f["follow"])
        ),
        _ => f.to_string(),
    }
}

#[cfg(test)]
mod tests;
