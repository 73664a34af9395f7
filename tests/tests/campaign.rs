//! The hostile-input campaign, quick mode: a seeded stream of hostile records on
//! `sortie.commands`, `sortie.step-results` and `sortie.graphs` (`sortie_fuzz::kafka`),
//! and hostile HTTP requests on every route of the gateway (`sortie_fuzz::http`), against
//! a real stack, while a canary tenant keeps starting runs through both
//! (`sortie_fuzz::campaign`). Every canary run must finish within its bound, every
//! hostile command must be answered or dead-lettered with a reason, no service may exit
//! or stay unready or grow past its memory bound, and `sortie audit replay --verify` must
//! be clean afterwards. The seed is printed; `SORTIE_CAMPAIGN_SEED` replays one and
//! `SORTIE_CAMPAIGN_CASES` sets the size (default 5,000: well under a minute). The long mode
//! is `sortie fuzz`.

use std::time::Duration;

use sortie_fuzz::campaign::{run, Gateway, Plan, Target};
use sortie_tests::stack::Stack;

/// The canary tenant starts runs; the hostile one has every role and none.
const TOKENS: &[&str] = &[
    "canary:canary-svc:operator:tok-canary",
    "hostile:mallory:operator,approver:tok-mallory",
    "hostile:eve::tok-eve",
];

const CANARY: &str = r#"
id: canary
version: 1
nodes:
  - {id: a, tool: echo, side_effect: pure, args: {c: $input.canary}}
  - {id: b, tool: echo, side_effect: pure, args: {c: $steps.a.output.c}}
edges:
  - {from: a, to: b}
"#;

/// Checked red: with the reducer's input key check off and its dead letters copying the
/// whole key, the first 600 KiB key stopped its partition (the letter, by reference too,
/// was refused) and every hostile record and canary behind it went unanswered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_campaign_hurts_no_canary_run() {
    let stack = Stack::start("campaign", &[CANARY]).await;
    let executor = stack.executor_process("executor", &["default"], &[]);
    let reducer = stack.reducer("0");
    let (gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), TOKENS)
        .await;
    let seed = sortie_tests::stack::seed_from_env("SORTIE_CAMPAIGN_SEED");
    let cases = sortie_tests::stack::env_number("SORTIE_CAMPAIGN_CASES", 5_000);
    let http_cases = cases / 5;
    sortie_tests::say(&format!(
        "campaign: seed {seed} (SORTIE_CAMPAIGN_SEED={seed} replays), {cases} cases"
    ));
    let target = Target {
        bootstrap: stack.bootstrap.clone(),
        topics: stack.topics.clone(),
        partitions: stack.partitions,
        codec: stack.codec.clone(),
        canary_graph: ("canary".into(), 1),
        canary_tenant: "canary".into(),
        hostile_tenant: "hostile".into(),
        processes: vec![
            (
                "reducer".into(),
                reducer.pid(),
                format!("{}/readyz", reducer.metrics_url().await),
            ),
            ("executor".into(), executor.pid(), String::new()),
            ("gateway".into(), gateway.pid(), format!("{url}/readyz")),
        ],
        gateway: Some(Gateway {
            url: url.clone(),
            hostile_tokens: vec!["tok-mallory".into(), "tok-eve".into()],
            canary_token: "tok-canary".into(),
            cases: http_cases,
        }),
    };
    let plan = Plan {
        seed,
        cases,
        canaries: 30,
        canary_bound: Duration::from_secs(30),
        settle: Duration::from_secs(90),
        max_rss_bytes: 1024 * 1024 * 1024,
    };
    let report = run(&target, &plan).await.expect("the campaign ran");
    eprintln!(
        "campaign: {}",
        serde_json::to_string_pretty(&report).unwrap_or_default()
    );
    assert!(
        report.problems.is_empty(),
        "seed {seed}: {:#?}",
        report.problems
    );
    assert_eq!(report.canaries_succeeded, plan.canaries);
    let (clean, audit) = stack.audit_verify().await;
    assert!(clean, "seed {seed}: the audit found a divergence: {audit}");
}
