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

/// Issue #57 item 6: the cross-tenant campaign (`sortie_fuzz::tenancy`). An attacker
/// tenant with every role, its own publisher key and its own receiver (on 127.0.0.2,
/// which the executor allows for the attacker only, as 127.0.0.1 — the victim's
/// receiver — for the victim only) tries every escape while the victim keeps starting
/// canary runs through the gateway: graph hijacks, reading the victim's secret, SSRF to
/// the victim's receiver, metadata and private addresses, giant and endless answers, slow
/// sockets, id squatting, commands and routes on the victim's runs. The oracle: every
/// canary succeeds within its bound on the victim's own graph; nothing of the victim's
/// reaches the attacker's receiver or answers; the victim's receiver never sees an
/// attacker's call. `SORTIE_TENANCY_CASES` sets the size (long mode: 5,000; see
/// docs/security.md). Seen red with the executor allowing 127.0.0.0/8 to every tenant
/// (`--egress-allow`): the victim's receiver recorded the attacker's calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cross_tenant_campaign_reaches_nothing_of_the_victim() {
    use sortie_fuzz::tenancy::{self, Attacker, Victim};
    use sortie_wire::signing::Signer;
    let stack = Stack::start("tenancy", &[]).await;
    let ledger = stack.ledger_process("victim-ledger", "keyed").await;
    stack
        .publish(&format!(
            "id: vault\nversion: 1\ndescription: {}\nnodes:\n  - {{id: pay, tool: http, side_effect: keyed, args: {{c: $input.canary}}, config: {{url: \"{}/effects/vault\"}}}}\n  - {{id: done, tool: echo, side_effect: pure, args: {{c: $steps.pay.output}}}}\nedges:\n  - {{from: pay, to: done}}\n",
            tenancy::VICTIM_GRAPH,
            ledger.url
        ))
        .await;
    let service = Signer::generate("attacker-svc").expect("key");
    let publisher = Signer::generate("attacker-pub").expect("key");
    let gateway_key = Signer::generate("gateway").expect("key");
    let attacker = ["attacker".to_owned()];
    let mut publishing = publisher.entry("pub:attacker", &attacker, &[], false);
    publishing.publisher = true;
    let keyring = stack.write_keyring(&[
        service.entry(
            "svc:attacker",
            &attacker,
            &["approver".into(), "operator".into(), "finance".into()],
            false,
        ),
        publishing,
        gateway_key.entry("gateway", &["victim".into(), "attacker".into()], &[], true),
    ]);
    let ring = keyring.to_str().expect("path").to_owned();
    let key_file = stack.dir.join("gateway.key");
    std::fs::write(&key_file, gateway_key.to_file()).expect("key file");
    let reducer = stack.reducer_with("0", &["--keyring", &ring, "--require-signatures"]);
    // The victim's secret, in the executor's environment (inherited by the spawn).
    let secret_value = format!("victim-secret-{}", std::process::id());
    std::env::set_var("SORTIE_SECRET_victim__KEY", &secret_value);
    let executor = stack.spawn(
        "executor",
        &[
            "executor",
            "--bootstrap-servers",
            &stack.bootstrap,
            "--registry-url",
            &stack.registry.url,
            "--prefix",
            &stack.prefix,
            "--queue",
            "default",
            "--executor-id",
            "executor",
            "--metrics-addr",
            "127.0.0.1:0",
            "--egress-allow-tenant",
            "victim=127.0.0.1/32",
            "--egress-allow-tenant",
            "attacker=127.0.0.2/32",
        ],
    );
    let (gateway, url) = stack
        .gateway_process_with(
            &stack.dir.join("gateway"),
            &[
                "victim:vic-svc:operator:tok-victim",
                "attacker:mallory:operator,approver,finance:tok-mallory",
                "attacker:eve::tok-eve",
            ],
            &[
                "--keyring",
                &ring,
                "--require-signatures",
                "--signing-key",
                key_file.to_str().expect("path"),
            ],
        )
        .await;
    let seed = sortie_tests::stack::seed_from_env("SORTIE_CAMPAIGN_SEED");
    let cases = sortie_tests::stack::env_number("SORTIE_TENANCY_CASES", 300);
    sortie_tests::say(&format!(
        "tenancy campaign: seed {seed} (SORTIE_CAMPAIGN_SEED={seed} replays), {cases} cases"
    ));
    let target = tenancy::Target {
        bootstrap: stack.bootstrap.clone(),
        topics: stack.topics.clone(),
        partitions: stack.partitions,
        codec: stack.codec.clone(),
        gateway_url: url.clone(),
        victim: Victim {
            tenant: "victim".into(),
            token: "tok-victim".into(),
            graph: ("vault".into(), 1),
            receiver_url: ledger.url.clone(),
            receiver_file: ledger.file.clone(),
            secret: ("SORTIE_SECRET_victim__KEY".into(), secret_value),
        },
        attacker: Attacker {
            tenant: "attacker".into(),
            tokens: vec!["tok-mallory".into(), "tok-eve".into()],
            signer: (service, "svc:attacker".into()),
            publisher: (publisher, "pub:attacker".into()),
            receiver_addr: std::net::Ipv4Addr::new(127, 0, 0, 2).into(),
        },
        processes: vec![
            ("reducer".into(), reducer.pid()),
            ("executor".into(), executor.pid()),
            ("gateway".into(), gateway.pid()),
        ],
    };
    let plan = tenancy::Plan {
        seed,
        cases,
        canaries: 20,
        canary_bound: Duration::from_secs(30),
        settle: Duration::from_secs(90),
        slow_sockets: sortie_tests::stack::env_number("SORTIE_TENANCY_SLOW_SOCKETS", 200),
    };
    let report = tenancy::run(&target, &plan)
        .await
        .expect("the campaign ran");
    eprintln!(
        "tenancy campaign: {}",
        serde_json::to_string_pretty(&report).unwrap_or_default()
    );
    assert!(
        report.problems.is_empty(),
        "seed {seed}: {:#?}",
        report.problems
    );
    assert_eq!(report.canaries_succeeded, plan.canaries);
    for code in ["step:egress_forbidden", "step:secret_forbidden"] {
        assert!(
            report.refusals.get(code).copied().unwrap_or(0) > 0 || cases < 50,
            "no {code} among {:?}",
            report.refusals
        );
    }
}
