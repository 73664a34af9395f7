//! `why` across a run's family (ADR 0028): an operation of a child run names the parent's
//! step that started the child and checks it (the `parent` link), and the parent's `$run`
//! operation names the child it started (the `child` link). The runs are folded by
//! `sortie_core::apply` alone, the effects that cross runs routed by this test as the
//! reducer routes them; the child's start is the record the reducer would have produced,
//! signed with its key.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, VecDeque};

use serde_json::{json, Value};
use sortie_catalog::Publication;
use sortie_core::child::ParentLink;
use sortie_core::input::{Command, CommandBody, Input};
use sortie_core::{apply, Effect, Event, EventBody, Graph, Graphs, Plain, RunState};
use sortie_why::{why, Chain, CommandRecord, Commands, Found, Inputs, Link, Status};
use sortie_wire::records as w;
use sortie_wire::signing::{keyring_text, Keyring, Signer};

const PLANNER: &str = r#"
id: planner
version: 1
nodes:
  - id: research
    run: {graph: researcher}
    args: {topic: $input.topic}
"#;

const RESEARCHER: &str = r#"
id: researcher
version: 1
nodes:
  - {id: search, tool: echo, side_effect: pure, args: {q: $input.topic}}
"#;

/// The parent `run_p` has started its child and the child's search is dispatched.
struct Family {
    graphs: Graphs,
    histories: BTreeMap<String, Vec<Event>>,
    runs: BTreeMap<String, RunState>,
    /// The commands a run sent another (the child's start), as folded.
    sent: Vec<Command>,
}

fn family() -> Family {
    let mut graphs = Graphs::new();
    for text in [PLANNER, RESEARCHER] {
        graphs.insert(Graph::parse(text).unwrap()).unwrap();
    }
    let mut family = Family {
        graphs,
        histories: BTreeMap::new(),
        runs: BTreeMap::new(),
        sent: Vec::new(),
    };
    let mut queue = VecDeque::from([Input::Command(Command {
        command_id: "start-p".into(),
        tenant: "acme".into(),
        run_id: "run_p".into(),
        principal: "user:ann".into(),
        roles: vec![],
        groups: vec![],
        at: 1_000,
        body: CommandBody::StartRun {
            graph_id: "planner".into(),
            graph_version: None,
            input: json!({"topic": "tides"}),
            labels: BTreeMap::new(),
            budget: None,
            fork: None,
            parent: None,
        },
    })]);
    let mut at = 1_000;
    while let Some(input) = queue.pop_front() {
        let run_id = input.run_id().to_owned();
        let applied = apply(family.runs.get(&run_id), &input, &family.graphs);
        for effect in applied.effects {
            match effect {
                Effect::Emit(e) if e.seq > 0 => {
                    family
                        .histories
                        .entry(e.run_id.clone())
                        .or_default()
                        .push(e);
                }
                Effect::Command(mut c) => {
                    at += 1;
                    c.at = at;
                    family.sent.push(c.clone());
                    queue.push_back(Input::Command(c));
                }
                _ => {}
            }
        }
        if let Some(state) = applied.state {
            family.runs.insert(run_id, state);
        }
    }
    family
}

impl Family {
    fn child(&self) -> &RunState {
        self.runs.values().find(|r| r.parent.is_some()).unwrap()
    }

    /// The operation of `step_id` in `run`.
    fn operation(&self, run: &str, step_id: &str) -> String {
        self.runs[run].steps[step_id].operation_id.clone()
    }

    /// The child's start as the reducer produced it to `sortie.commands`: its value and
    /// headers (signed by `signer`, when given) and the record the topic holds.
    fn start_record(&self, signer: Option<&Signer>) -> Found {
        let start = &self.sent[0];
        let CommandBody::StartRun {
            graph_id,
            input,
            parent,
            ..
        } = &start.body
        else {
            panic!("a start")
        };
        let command = w::RunCommand {
            command_id: start.command_id.clone(),
            tenant: start.tenant.clone(),
            run_id: start.run_id.clone(),
            issuer: w::Issuer {
                principal: start.principal.clone(),
                roles: vec![],
                groups: vec![],
            },
            issued_at: start.at,
            body: w::CommandBody::StartRun(w::StartRun {
                graph_id: graph_id.clone(),
                graph_version: None,
                input: input.to_string(),
                labels: BTreeMap::new(),
                budget: None,
                fork: None,
                parent: parent.as_ref().map(|p| serde_json::to_string(p).unwrap()),
            }),
        };
        let value =
            format!("\0\0\0\0\x07{}", serde_json::to_string(&command).unwrap()).into_bytes();
        let headers = signer
            .map(|s| {
                s.headers(&value)
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), Some(v)))
                    .collect()
            })
            .unwrap_or_default();
        Found::Record(Box::new(CommandRecord {
            partition: 3,
            offset: 7,
            value,
            headers,
            command,
        }))
    }
}

/// The reducer's delegate key, and a keyring holding it.
fn reducer_key() -> (Signer, Keyring) {
    let signer = Signer::from_seed("reducer", [7; 32]);
    let keyring = Keyring::parse(&keyring_text(&[signer.entry(
        "reducer",
        &["acme".to_owned()],
        &[],
        true,
    )]))
    .unwrap();
    (signer, keyring)
}

/// Commands by command id.
struct Table(BTreeMap<String, Found>);

impl Commands for Table {
    fn find(&mut self, _run_id: &str, command_id: &str, _at: i64) -> Found {
        self.0.get(command_id).cloned().unwrap_or(Found::Missing)
    }
}

fn chain(
    family: &Family,
    run: &str,
    history: &[Event],
    operation_id: &str,
    start: Found,
    keyring: &Keyring,
) -> Chain {
    let state = &family.runs[run];
    let graph = family
        .graphs
        .get(&state.graph_id, Some(state.graph_version))
        .unwrap();
    let publication = Publication {
        key: format!("{}@{}", state.graph_id, state.graph_version),
        definition_hash: "d".into(),
        tenant: None,
        published_by: "ops".into(),
        published_at: 0,
        signed_by: Some("publisher".into()),
    };
    let start_id = family.sent[0].command_id.clone();
    let mut commands = Table([(start_id, start)].into_iter().collect());
    why(Inputs {
        operation_id,
        history,
        seal: &Plain,
        readable: true,
        graph: Some(graph),
        publication: Some(&publication),
        keyring: Some(keyring),
        commands: &mut commands,
    })
}

fn link<'c>(chain: &'c Chain, name: &str) -> &'c Link {
    chain
        .links
        .iter()
        .find(|l| l.link == name)
        .unwrap_or_else(|| panic!("no {name} link in {}", sortie_why::render(chain)))
}

/// `history` with `change` made to its events and every hash chained anew: a consistent
/// history the hash chain alone cannot tell from the written one.
fn forged(history: &[Event], change: impl Fn(&mut Event)) -> Vec<Event> {
    let mut out = history.to_vec();
    let mut prev = None;
    for event in &mut out {
        change(event);
        event.prev_hash = prev.clone();
        event.hash = Some(event.compute_hash());
        prev = event.hash.clone();
    }
    out
}

#[test]
fn a_childs_operation_names_the_parents_step_and_verifies_it_given_the_parents_history() {
    let family = family();
    let (signer, keyring) = reducer_key();
    let child = family.child();
    let parent = child.parent.clone().unwrap();
    let search = family.operation(&child.run_id, "search#1");
    let history = &family.histories[&child.run_id];

    let mut chain = chain(
        &family,
        &child.run_id,
        history,
        &search,
        family.start_record(Some(&signer)),
        &keyring,
    );
    // Without the parent's history: everything else holds, the dispatch is unchecked.
    let up = link(&chain, "parent");
    assert_eq!(
        up.status,
        Status::Unchecked,
        "{}",
        sortie_why::render(&chain)
    );
    assert!(
        up.problems[0].contains("the history of run run_p is not at hand"),
        "{:?}",
        up.problems
    );
    assert!(!chain.verified);
    assert!(chain
        .links
        .iter()
        .filter(|l| l.link != "parent")
        .all(|l| l.status == Status::Verified));
    assert_eq!(chain.parent(), Some(&parent));
    assert_eq!(up.facts["run_id"], "run_p");
    assert_eq!(up.facts["step_id"], json!(parent.step_id));
    assert_eq!(up.facts["operation_id"], json!(parent.operation_id));
    assert_eq!(up.facts["attempt"], 1);
    assert_eq!(up.facts["derived_run_id"], json!(child.run_id));
    assert_eq!(up.facts["started_by"], "run:run_p");
    assert_eq!(up.facts["start_command"]["key_id"], "reducer");
    assert_eq!(up.facts["start_command"]["signature"], "verified");
    assert_eq!(
        up.facts["start_command"]["record"],
        json!({"partition": 3, "offset": 7})
    );
    let follow = format!("sortie audit why {} --run run_p", parent.operation_id);
    assert_eq!(up.facts["follow"], json!(follow));
    assert!(sortie_why::render(&chain).contains(&follow));

    // With it: the parent dispatched that operation as a child run, and the chain holds.
    chain.check_parent(&family.histories["run_p"]);
    assert!(chain.verified, "{}", sortie_why::render(&chain));
    let up = link(&chain, "parent");
    assert_eq!(up.facts["dispatch"]["tool"], "$run");
    assert_eq!(up.facts["dispatch"]["node"], "research");

    // Following it upward: the parent's operation names this child.
    let mut commands = Table(BTreeMap::new());
    let planner = family.graphs.get("planner", Some(1)).unwrap();
    let publication = Publication {
        key: "planner@1".into(),
        definition_hash: "d".into(),
        tenant: None,
        published_by: "ops".into(),
        published_at: 0,
        signed_by: Some("publisher".into()),
    };
    let up_chain = why(Inputs {
        operation_id: &parent.operation_id,
        history: &family.histories["run_p"],
        seal: &Plain,
        readable: true,
        graph: Some(planner),
        publication: Some(&publication),
        keyring: Some(&keyring),
        commands: &mut commands,
    });
    assert!(up_chain.verified, "{}", sortie_why::render(&up_chain));
    assert!(up_chain.parent().is_none());
    let down = link(&up_chain, "child");
    assert_eq!(
        down.facts["runs"],
        json!([{"attempt": 1, "run_id": child.run_id, "follow": format!("sortie run get {}", child.run_id)}])
    );
    assert_eq!(down.facts["graph"], "researcher");
    assert!(sortie_why::render(&up_chain).contains(&format!("sortie run get {}", child.run_id)));
    // An operation of a run that is nobody's child has no parent link.
    assert!(!up_chain.links.iter().any(|l| l.link == "parent"));
}

#[test]
fn a_forged_parent_link_is_named_broken() {
    let family = family();
    let (signer, keyring) = reducer_key();
    let child = family.child();
    let search = family.operation(&child.run_id, "search#1");
    let history = &family.histories[&child.run_id];
    let parent_history = &family.histories["run_p"];
    let broken = |chain: &Chain| {
        let up = link(chain, "parent");
        assert_eq!(up.status, Status::Broken, "{}", sortie_why::render(chain));
        assert!(!chain.verified);
        up.problems.join("; ")
    };

    // The link claims another attempt: it does not derive the child's id.
    let other_attempt = forged(history, |e| {
        if let EventBody::RunStarted {
            parent: Some(p), ..
        } = &mut e.body
        {
            p.attempt = 2;
        }
    });
    let mut c = chain(
        &family,
        &child.run_id,
        &other_attempt,
        &search,
        family.start_record(Some(&signer)),
        &keyring,
    );
    c.check_parent(parent_history);
    let problems = broken(&c);
    assert!(
        problems.contains("is not the child run its parent link derives"),
        "{problems}"
    );
    assert_eq!(link(&c, "history").status, Status::Verified);

    // Started by someone other than the parent.
    let squatter = forged(history, |e| {
        if let EventBody::RunStarted { started_by, .. } = &mut e.body {
            *started_by = "user:mallory".into();
        }
    });
    let c = chain(
        &family,
        &child.run_id,
        &squatter,
        &search,
        family.start_record(Some(&signer)),
        &keyring,
    );
    let problems = broken(&c);
    assert!(
        problems.contains("was started by user:mallory, not by its parent (run:run_p)"),
        "{problems}"
    );

    // A start nobody sent, or one not signed.
    let c = chain(
        &family,
        &child.run_id,
        history,
        &search,
        Found::Missing,
        &keyring,
    );
    assert!(broken(&c).contains("the history names a start nobody sent"));
    let c = chain(
        &family,
        &child.run_id,
        history,
        &search,
        family.start_record(None),
        &keyring,
    );
    assert!(broken(&c).contains("is not signed"));

    // The parent's history does not hold the dispatch: another run's history, none, or
    // one where the operation went to another tool.
    let mut c = chain(
        &family,
        &child.run_id,
        history,
        &search,
        family.start_record(Some(&signer)),
        &keyring,
    );
    c.check_parent(&[]);
    assert!(broken(&c).contains("run run_p has no history"));
    c.check_parent(history);
    assert!(broken(&c).contains("holds an event of run sub_"));
    let not_a_child = forged(parent_history, |e| {
        if let EventBody::StepDispatched { tool, .. } = &mut e.body {
            *tool = "http".into();
        }
    });
    c.check_parent(&not_a_child);
    assert!(
        broken(&c).contains("which starts no child run"),
        "{}",
        sortie_why::render(&c)
    );
    let no_dispatch: Vec<Event> = parent_history
        .iter()
        .filter(|e| !matches!(e.body, EventBody::StepDispatched { .. }))
        .cloned()
        .collect();
    c.check_parent(&no_dispatch);
    assert!(broken(&c).contains("dispatched no operation"));
    // The real one again: it holds.
    c.check_parent(parent_history);
    assert!(c.verified, "{}", sortie_why::render(&c));
}

#[test]
fn without_a_keyring_or_the_parents_history_the_parent_link_is_unchecked_not_broken() {
    let family = family();
    let child = family.child();
    let search = family.operation(&child.run_id, "search#1");
    let history = &family.histories[&child.run_id];
    let graph = family.graphs.get("researcher", Some(1)).unwrap();
    // The start is on the topic, unsigned, and there is no keyring to check it by.
    let mut commands = Table(
        [(family.sent[0].command_id.clone(), family.start_record(None))]
            .into_iter()
            .collect(),
    );
    let mut chain = why(Inputs {
        operation_id: &search,
        history,
        seal: &Plain,
        readable: true,
        graph: Some(graph),
        publication: None,
        keyring: None,
        commands: &mut commands,
    });
    let up = link(&chain, "parent");
    assert_eq!(
        up.status,
        Status::Unchecked,
        "{}",
        sortie_why::render(&chain)
    );
    let problems: Vec<&str> = up.problems.iter().map(String::as_str).collect();
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert!(problems[0].contains("no keyring"), "{problems:?}");
    assert!(problems[1].contains("is not at hand"), "{problems:?}");
    chain.check_parent(&family.histories["run_p"]);
    let up = link(&chain, "parent");
    assert_eq!(
        up.status,
        Status::Unchecked,
        "only the keyring is missing now"
    );
    assert_eq!(up.problems.len(), 1);
    assert_eq!(up.facts["dispatch"]["tool"], "$run");
    // JSON: the link as the gateway and `audit why --json` show it.
    let value: Value = serde_json::to_value(&chain).unwrap();
    let parent = value["links"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["link"] == "parent")
        .unwrap();
    assert_eq!(parent["status"], "unchecked");
    assert!(value.get("parent").is_none(), "{value}");
    let _: ParentLink = serde_json::from_value(json!({
        "run_id": parent["facts"]["run_id"],
        "step_id": parent["facts"]["step_id"],
        "operation_id": parent["facts"]["operation_id"],
        "attempt": parent["facts"]["attempt"],
    }))
    .unwrap();
}
