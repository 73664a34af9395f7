//! The web console (`/ui`) in a real browser: headless Chromium driven over WebDriver
//! against a gateway process, a reducer process, an executor process and the ledger as
//! the refund's receiver, all on the real broker.
//!
//! An approver signs in with her bearer token, finds the refund in the approval inbox with
//! its arguments, rationale and what a rejection would do, approves it, and watches the
//! run page reach `succeeded` live; the ledger shows the refund happened once. She edits
//! another refund's amount, which becomes a new proposal she approves in turn. A principal
//! without the approver role sees why he may not decide, and the refusal when he clicks
//! anyway. An operator records the real outcome of a payout whose answer was lost, and
//! cancels a run through the confirmation dialog. The pages carry the console's security headers and the token never appears in
//! a URL.
//!
//! The test was seen to fail: with the approve button bound to a wrong proposal hash
//! (`proposal_hash: item.proposal_hash + "x"` in `app.js`) the gateway refused the
//! decision as `stale_proposal`, the console showed it as a stale proposal, and this test
//! went red; with the binding restored it passes.
//!
//! A run that waits for a signal takes it from the run page's form, after the page showed
//! a payload the wait's schema refuses. A person talks with a conversation from its run
//! page's message box, and ends it there.
//!
//! Screenshots of the inbox (an approver's, and a viewer's after a refusal), a run page,
//! a run page's open wait, a conversation's message box, the runs list and the operator
//! page go to `docs/console-*.png` when `SORTIE_SCREENSHOTS=docs`, otherwise to the
//! test's directory.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};
use sortie_tests::browser::Browser;
use sortie_tests::stack::Stack;

const LONG: Duration = Duration::from_secs(90);
const SHORT: Duration = Duration::from_secs(20);

const ALICE: &str = "acme:user:alice:approver:tok-alice";
const BOB: &str = "acme:user:bob:viewer:tok-bob";
const OLGA: &str = "acme:user:olga:operator:tok-olga";

/// A payout whose receiver's answer is lost: `unsafe`, so never retried, and the run
/// waits for an operator to record what happened.
fn payout_graph(ledger: &str) -> Value {
    json!({
        "id": "payout",
        "version": 1,
        "nodes": [
            {
                "id": "send_payout", "tool": "http", "queue": "http", "side_effect": "unsafe",
                "args": {"payee": "$input.payee", "amount": "$input.amount"},
                "config": {"url": format!("{ledger}/effects/payout")},
                "timeout": "10s"
            },
            {"id": "receipt", "tool": "echo", "side_effect": "pure", "args": {"payout": "$steps.send_payout.output"}}
        ],
        "edges": [{"from": "send_payout", "to": "receipt"}]
    })
}

/// The refund story: read the order, check the policy, a gated refund to the ledger whose
/// arguments carry the agent's rationale, then notify the customer.
fn refund_graph(ledger: &str) -> Value {
    let url = |name: &str| json!({ "url": format!("{ledger}/effects/{name}") });
    json!({
        "id": "refund",
        "version": 1,
        "description": "Refund an order after a policy check and a human approval.",
        "nodes": [
            {
                "id": "read_order", "tool": "echo", "side_effect": "pure",
                "args": {"order_id": "$input.order_id", "total": "$input.total", "currency": "$input.currency"}
            },
            {
                "id": "check_policy", "tool": "echo", "side_effect": "pure",
                "args": {"order_id": "$steps.read_order.output.order_id", "total": "$steps.read_order.output.total"}
            },
            {
                "id": "refund", "tool": "http", "queue": "http", "side_effect": "keyed",
                "args": {
                    "order_id": "$steps.read_order.output.order_id",
                    "amount": "$steps.read_order.output.total",
                    "currency": "$steps.read_order.output.currency",
                    "rationale": "$input.rationale",
                    "note": "$interrupt.payload.note"
                },
                "config": url("refund"),
                "timeout": "30s",
                "interrupt_before": {
                    "reason": "A refund moves money; an approver confirms the amount.",
                    "required_role": "approver",
                    "timeout": "24h"
                }
            },
            {
                "id": "notify_customer", "tool": "http", "queue": "http", "side_effect": "idempotent",
                "args": {"order_id": "$steps.read_order.output.order_id", "refund": "$steps.refund.output.ledger_seq"},
                "config": url("notify"),
                "timeout": "30s"
            }
        ],
        "edges": [
            {"from": "read_order", "to": "check_policy"},
            {"from": "check_policy", "to": "refund"},
            {"from": "refund", "to": "notify_customer"}
        ]
    })
}

fn screenshot_path(stack: &Stack, name: &str) -> PathBuf {
    match std::env::var("SORTIE_SCREENSHOTS").as_deref() {
        Ok("docs") => sortie_tests::workspace_root()
            .join("docs")
            .join(format!("console-{name}.png")),
        _ => stack.dir.join(format!("console-{name}.png")),
    }
}

async fn start_run(client: &reqwest::Client, url: &str, run_id: &str, total: u32, why: &str) {
    let answer = client
        .post(format!("{url}/v1/runs"))
        .bearer_auth("tok-bob")
        .json(&json!({
            "graph_id": "refund",
            "run_id": run_id,
            "labels": {"channel": "support", "order": run_id},
            "input": {"order_id": run_id, "total": total, "currency": "EUR", "rationale": why}
        }))
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(answer.status().as_u16(), 201, "{:?}", answer.text().await);
}

async fn get_run(client: &reqwest::Client, url: &str, run_id: &str) -> Value {
    client
        .get(format!("{url}/v1/runs/{run_id}"))
        .bearer_auth("tok-alice")
        .send()
        .await
        .expect("the gateway answers")
        .json()
        .await
        .expect("JSON")
}

async fn run_status(client: &reqwest::Client, url: &str, run_id: &str) -> String {
    let run = get_run(client, url, run_id).await;
    run["status"].as_str().unwrap_or_default().to_owned()
}

async fn sign_in(browser: &Browser, url: &str, token: &str) {
    browser.goto(&format!("{url}/ui/#/login")).await;
    browser.replace_text("#login-token", token, SHORT).await;
    browser.click("#login-submit", SHORT).await;
    // Signed in: the header names the principal, and the inbox opens.
    browser
        .wait_text("the signed-in principal", "#who-name", SHORT, |t| {
            t.contains("acme")
        })
        .await;
    browser
        .wait_for("the inbox to load", "#inbox-list > *", SHORT)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approver_decides_in_the_console_and_a_viewer_is_told_why_not() {
    let stack = Stack::start("console", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack.publish(&refund_graph(&ledger.url).to_string()).await;
    stack.publish(&payout_graph(&ledger.url).to_string()).await;
    let _reducer = stack.reducer("0");
    let _executor =
        stack.executor_process("executor", &["default", "http"], &["--static-membership"]);
    let (_gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), &[ALICE, BOB, OLGA])
        .await;
    let client = reqwest::Client::new();

    // The console's own files carry the security headers.
    let page = client
        .get(format!("{url}/ui/"))
        .send()
        .await
        .expect("the console page");
    assert_eq!(page.status().as_u16(), 200);
    let header = |name: &str| {
        page.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let csp = header("content-security-policy");
    assert!(
        csp.contains("script-src 'self'") && !csp.contains("unsafe-inline"),
        "{csp}"
    );
    assert_eq!(header("x-content-type-options"), "nosniff");
    assert_eq!(header("cache-control"), "no-cache");
    let (status, body) = {
        let r = client
            .get(format!("{url}/ui/nope.js"))
            .send()
            .await
            .expect("answer");
        (r.status().as_u16(), r.json::<Value>().await.expect("JSON"))
    };
    assert_eq!((status, &body["error"]["code"]), (404, &json!("not_found")));

    start_run(
        &client,
        &url,
        "order-1042",
        120,
        "The parcel arrived crushed; photos attached to the ticket.",
    )
    .await;
    start_run(
        &client,
        &url,
        "order-1043",
        35,
        "Customer was charged twice for one order.",
    )
    .await;
    start_run(
        &client,
        &url,
        "order-1044",
        60,
        "Half of the order was missing.",
    )
    .await;
    for run in ["order-1042", "order-1043", "order-1044"] {
        sortie_tests::wait_until("the run to wait for approval", LONG, || async {
            run_status(&client, &url, run).await == "waiting_approval"
        })
        .await;
    }

    let browser = Browser::start(&stack.dir.join("chromedriver.log"), 1280, 1000).await;

    // ---- A token the gateway does not know is refused at the door.
    browser.goto(&format!("{url}/ui/#/login")).await;
    browser.type_into("#login-token", "tok-nobody", SHORT).await;
    browser.click("#login-submit", SHORT).await;
    browser
        .wait_text("the unknown token's refusal", "#login-status", SHORT, |t| {
            t.contains("not known")
        })
        .await;

    // ---- Alice approves order-1042 from the inbox.
    sign_in(&browser, &url, "tok-alice").await;
    let item = ".inbox-item[data-run-id='order-1042']";
    browser
        .wait_for("order-1042 in the inbox", item, LONG)
        .await;
    let args = browser
        .text(&format!("{item} .proposal-args"))
        .await
        .unwrap_or_default();
    assert!(
        args.contains("\"amount\": 120") && args.contains("\"order_id\": \"order-1042\""),
        "{args}"
    );
    assert_eq!(
        browser.text(&format!("{item} .rationale")).await.as_deref(),
        Some("The parcel arrived crushed; photos attached to the ticket.")
    );
    assert_eq!(
        browser.text(&format!("{item} .on-reject")).await.as_deref(),
        Some("The run fails; completed steps that declare a compensation are undone.")
    );
    assert_eq!(
        browser.text(&format!("{item} .affects")).await.as_deref(),
        Some("http on refund (keyed)"),
        "what the step affects"
    );
    assert!(browser.all(&format!("{item} .why-not")).await.is_empty());
    // Her input goes to the call ($interrupt.payload.note in the node's arguments).
    browser
        .replace_text(
            &format!("{item} textarea.human-input"),
            r#"{"note": "photos checked"}"#,
            SHORT,
        )
        .await;
    browser.screenshot(&screenshot_path(&stack, "inbox")).await;

    browser
        .click(&format!("{item} button.approve"), SHORT)
        .await;
    // The answer shows either as the "Approved" notice or as a refusal on the item.
    let decided = browser
        .wait_text(
            "the approval to be answered",
            &format!("#inbox-flash .decided, {item} .refusal"),
            LONG,
            |t| !t.is_empty(),
        )
        .await;
    assert!(
        decided.starts_with("Approved refund in run order-1042"),
        "the approval was not accepted: {decided}"
    );
    assert!(
        !browser.url().await.contains("tok-"),
        "the token never enters a URL"
    );

    // The run page follows the run live to its end.
    browser.goto(&format!("{url}/ui/#/runs/order-1042")).await;
    browser
        .wait_for(
            "the run page to show succeeded",
            "#run-status [data-status='succeeded']",
            LONG,
        )
        .await;
    browser
        .wait_text("the live stream", "#live-state", SHORT, |t| {
            t.contains("live")
        })
        .await;
    let steps = browser
        .wait_text(
            "the timeline to show every step",
            "#steps-table",
            SHORT,
            |t| t.contains("notify_customer") && !t.contains("in flight"),
        )
        .await;
    assert!(
        steps.contains("refund") && steps.contains("keyed") && steps.contains("succeeded"),
        "{steps}"
    );
    let approvals = browser.text("#approvals-table").await.unwrap_or_default();
    assert!(
        approvals.contains("approved by user:alice") && approvals.contains("approved"),
        "{approvals}"
    );
    browser.screenshot(&screenshot_path(&stack, "run")).await;
    browser
        .click("#run-checkpoint button[type='submit']", SHORT)
        .await;
    browser
        .wait_text(
            "the latest checkpoint's state",
            "#checkpoint-state",
            SHORT,
            |t| t.contains("ckpt_order-1042_") && t.contains("\"status\""),
        )
        .await;

    let snapshot = ledger.snapshot().await;
    let refunds: Vec<_> = snapshot
        .calls
        .iter()
        .filter(|c| c.name == "refund" && c.effect && c.body["order_id"] == "order-1042")
        .collect();
    assert_eq!(refunds.len(), 1, "one refund for order-1042: {snapshot:#?}");
    assert_eq!(refunds[0].body["order_id"], "order-1042");
    assert_eq!(
        refunds[0].body["note"], "photos checked",
        "the approver's input reached the call: {snapshot:#?}"
    );

    // The runs list shows both runs, filtered by status and label.
    browser.goto(&format!("{url}/ui/#/runs")).await;
    browser
        .wait_for(
            "order-1042 in the list",
            "#runs-table tr[data-run-id='order-1042']",
            SHORT,
        )
        .await;
    browser
        .wait_for(
            "order-1043 in the list",
            "#runs-table tr[data-run-id='order-1043']",
            SHORT,
        )
        .await;
    browser.screenshot(&screenshot_path(&stack, "runs")).await;
    browser
        .type_into("#filter-label", "order=order-1043", SHORT)
        .await;
    browser
        .click("#runs-filters button[type='submit']", SHORT)
        .await;
    sortie_tests::wait_until("the label filter to apply", SHORT, || async {
        browser
            .all("#runs-table tr[data-run-id='order-1042']")
            .await
            .is_empty()
            && !browser
                .all("#runs-table tr[data-run-id='order-1043']")
                .await
                .is_empty()
    })
    .await;
    browser.click("#runs-filters button.link", SHORT).await;

    // ---- Alice edits order-1044's amount: the edited call is a new proposal (the node
    // does not allow edits), which she approves in turn; the ledger refunds the new amount.
    browser.goto(&format!("{url}/ui/#/inbox")).await;
    let item = ".inbox-item[data-run-id='order-1044']";
    browser.click(&format!("{item} button.edit"), SHORT).await;
    browser
        .replace_text(
            &format!("{item} textarea.edit-args"),
            r#"{"amount": 30, "currency": "EUR", "order_id": "order-1044", "rationale": "Half of the order was missing."}"#,
            SHORT,
        )
        .await;
    browser
        .click(&format!("{item} button.approve-edited"), SHORT)
        .await;
    let edited = browser
        .wait_text(
            "the edited approval to be answered",
            &format!("#inbox-flash .decided, {item} .refusal"),
            LONG,
            |t| !t.is_empty(),
        )
        .await;
    assert!(
        edited.starts_with("Approved refund in run order-1044") && edited.contains("edited"),
        "{edited}"
    );
    let args = browser
        .wait_text(
            "the edited call as a new proposal",
            &format!("{item} .proposal-args"),
            LONG,
            |t| t.contains("\"amount\": 30"),
        )
        .await;
    assert!(args.contains("order-1044"), "{args}");
    let diff = browser
        .text(&format!("{item} .affects-diff"))
        .await
        .unwrap_or_default();
    assert!(
        diff.contains("amount") && diff.contains("→ 30"),
        "the new proposal shows what the edit changed: {diff}"
    );
    browser
        .click(&format!("{item} button.approve"), SHORT)
        .await;
    browser
        .wait_text(
            "the new proposal's approval",
            "#inbox-flash .decided",
            LONG,
            |t| t.starts_with("Approved refund in run order-1044") && !t.contains("edited"),
        )
        .await;
    sortie_tests::wait_until("order-1044 to succeed", LONG, || async {
        run_status(&client, &url, "order-1044").await == "succeeded"
    })
    .await;
    let snapshot = ledger.snapshot().await;
    let refunded: Vec<_> = snapshot
        .calls
        .iter()
        .filter(|c| c.name == "refund" && c.effect && c.body["order_id"] == "order-1044")
        .map(|c| c.body["amount"].clone())
        .collect();
    assert_eq!(refunded, [json!(30)], "{snapshot:#?}");

    // ---- Bob, a viewer, is told why he may not decide, and refused when he tries.
    browser.click("#sign-out", SHORT).await;
    browser
        .wait_for("the sign-in page", "#login-token", SHORT)
        .await;
    sign_in(&browser, &url, "tok-bob").await;
    let item = ".inbox-item[data-run-id='order-1043']";
    browser
        .wait_for("order-1043 in Bob's inbox", item, LONG)
        .await;
    assert_eq!(
        browser
            .text(&format!("{item} .why-not-text"))
            .await
            .as_deref(),
        Some("deciding needs role \"approver\"; user:bob has roles viewer")
    );
    browser
        .click(&format!("{item} button.approve"), SHORT)
        .await;
    let refusal = browser
        .wait_text(
            "the refusal to show",
            &format!("{item} .refusal"),
            LONG,
            |t| !t.is_empty(),
        )
        .await;
    assert!(
        refusal.starts_with("Refused (forbidden)") && refusal.contains("approver"),
        "{refusal}"
    );
    assert_eq!(
        run_status(&client, &url, "order-1043").await,
        "waiting_approval"
    );
    browser
        .screenshot(&screenshot_path(&stack, "inbox-refused"))
        .await;

    // ---- Olga, an operator, records a lost payout's real outcome and cancels a run.
    ledger.fault(json!({"drop_after_commit": true})).await;
    let answer = client
        .post(format!("{url}/v1/runs"))
        .bearer_auth("tok-olga")
        .json(&json!({"graph_id": "payout", "run_id": "payout-7", "input": {"payee": "ACME Supplies", "amount": 480}}))
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(answer.status().as_u16(), 201);
    sortie_tests::wait_until("the payout to need an operator", LONG, || async {
        run_status(&client, &url, "payout-7").await == "needs_reconciliation"
    })
    .await;
    browser.click("#sign-out", SHORT).await;
    sign_in(&browser, &url, "tok-olga").await;
    browser.goto(&format!("{url}/ui/#/operator")).await;
    let form = "form.reconcile[data-run-id='payout-7']";
    browser
        .wait_for("the payout's reconcile form", form, SHORT)
        .await;
    browser
        .wait_for(
            "order-1043 among runs in progress",
            "#operator-runs tr[data-run-id='order-1043']",
            SHORT,
        )
        .await;
    browser
        .screenshot(&screenshot_path(&stack, "operator"))
        .await;
    browser
        .click(&format!("{form} option[value='succeeded']"), SHORT)
        .await;
    browser
        .type_into(
            &format!("{form} textarea.result"),
            r#"{"payout_id": "po-77"}"#,
            SHORT,
        )
        .await;
    browser
        .click(&format!("{form} button[type='submit']"), SHORT)
        .await;
    browser
        .wait_text("the outcome to be recorded", "#operator-flash", LONG, |t| {
            t.contains("payout-7")
        })
        .await;
    sortie_tests::wait_until("the payout to finish", LONG, || async {
        run_status(&client, &url, "payout-7").await == "succeeded"
    })
    .await;
    let payouts = ledger
        .snapshot()
        .await
        .calls
        .iter()
        .filter(|c| c.name == "payout")
        .count();
    assert_eq!(payouts, 1, "the operator's answer calls nobody again");

    // Cancel asks first; keeping the run changes nothing.
    let cancel = "#operator-runs tr[data-run-id='order-1043'] button.cancel";
    browser.click(cancel, SHORT).await;
    browser.click("#confirm-no", SHORT).await;
    assert_eq!(
        run_status(&client, &url, "order-1043").await,
        "waiting_approval"
    );
    browser.click(cancel, SHORT).await;
    browser
        .type_into("#confirm-reason", "duplicate ticket", SHORT)
        .await;
    browser.click("#confirm-yes", SHORT).await;
    browser
        .wait_text(
            "the cancellation to be accepted",
            "#operator-flash",
            LONG,
            |t| t.contains("order-1043"),
        )
        .await;
    sortie_tests::wait_until("order-1043 to be cancelled", LONG, || async {
        run_status(&client, &url, "order-1043").await == "cancelled"
    })
    .await;

    let errors = browser.console_errors().await;
    assert!(
        errors
            .iter()
            .all(|e| !e.contains("Content Security Policy")),
        "the console breaks its own policy: {errors:?}"
    );
}

/// A new hire's onboarding: order the laptop, wait for the carrier's signal that it was
/// delivered (its payload held to a schema), then welcome the hire with the tracking number.
fn onboarding_graph() -> Value {
    json!({
        "id": "onboarding",
        "version": 1,
        "nodes": [
            {"id": "order", "tool": "echo", "side_effect": "pure", "args": {"laptop": "$input.laptop"}},
            {
                "id": "delivered",
                "wait": {
                    "signal": "laptop_delivered",
                    "schema": {
                        "type": "object",
                        "required": ["tracking"],
                        "properties": {"tracking": {"type": "string"}}
                    }
                }
            },
            {
                "id": "welcome", "tool": "echo", "side_effect": "pure",
                "args": {"tracking": "$steps.delivered.output.payload.tracking"}
            }
        ],
        "edges": [
            {"from": "order", "to": "delivered"},
            {"from": "delivered", "to": "welcome"}
        ]
    })
}

/// A run waiting for a signal, from the run page: the open wait shows its signal and
/// deadline and that it took nothing yet; a payload that is not JSON is reported in the
/// page and not sent; one that fails the wait's schema is refused (`invalid_payload`) and
/// shown so; the right one is taken, the run reaches `succeeded` live, the signal's events
/// read as lines, and the step after the wait got the payload (checked on the HTTP API).
///
/// Seen red once: with the console posting to `/v1/runs/{id}/signal/{name}` (a wrong
/// path) the gateway answered `not_found`, the page showed "Not sent (not_found): no such
/// route" where `invalid_payload` was expected, and this test failed; with the path
/// restored it passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_sent_from_the_run_page_is_checked_taken_and_moves_the_run_on() {
    let stack = Stack::start("console-signal", &[]).await;
    stack.publish(&onboarding_graph().to_string()).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let (_gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), &[ALICE])
        .await;
    let client = reqwest::Client::new();
    let answer = client
        .post(format!("{url}/v1/runs"))
        .bearer_auth("tok-alice")
        .json(&json!({"graph_id": "onboarding", "run_id": "hire-7", "input": {"laptop": "X1"}}))
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(answer.status().as_u16(), 201, "{:?}", answer.text().await);
    sortie_tests::wait_until("the run to wait for its signal", LONG, || async {
        run_status(&client, &url, "hire-7").await == "waiting_signal"
    })
    .await;
    let run = get_run(&client, &url, "hire-7").await;
    assert_eq!(run["open_waits"], json!(["laptop_delivered"]), "{run:#}");

    let browser = Browser::start(&stack.dir.join("chromedriver.log"), 1280, 1000).await;
    sign_in(&browser, &url, "tok-alice").await;
    browser.goto(&format!("{url}/ui/#/runs/hire-7")).await;
    browser
        .wait_for(
            "the run page to show waiting for a signal",
            "#run-status [data-status='waiting_signal']",
            LONG,
        )
        .await;
    let wait = "#run-waits .wait[data-signal='laptop_delivered']";
    let shown = browser
        .wait_text("the open wait", wait, SHORT, |t| t.contains("Deadline"))
        .await;
    assert_eq!(
        browser
            .text(&format!("{wait} .signal-name"))
            .await
            .as_deref(),
        Some("laptop_delivered")
    );
    assert!(
        shown.contains("node delivered")
            && shown.contains("nothing yet")
            && shown.contains("Send signal laptop_delivered"),
        "{shown}"
    );
    let payload = format!("{wait} textarea.signal-payload");
    let send = format!("{wait} button.send-signal");

    // Not JSON: said in the page, nothing sent.
    browser
        .replace_text(&payload, r#"{"tracking": "#, SHORT)
        .await;
    browser.click(&send, SHORT).await;
    browser
        .wait_text(
            "the bad JSON to be reported",
            &format!("{wait} .signal-refusal.code-bad_json"),
            SHORT,
            |t| t.contains("not valid JSON"),
        )
        .await;

    // A payload the wait's schema refuses: the gateway's code and message are shown.
    browser
        .replace_text(&payload, r#"{"tracking": 7}"#, SHORT)
        .await;
    browser.click(&send, SHORT).await;
    let refused = browser
        .wait_text(
            "the schema's refusal",
            &format!("{wait} .signal-refusal"),
            LONG,
            |t| !t.contains("not valid JSON"),
        )
        .await;
    assert!(
        refused.starts_with("Not sent (invalid_payload)") && refused.contains("tracking"),
        "{refused}"
    );
    assert_eq!(run_status(&client, &url, "hire-7").await, "waiting_signal");

    browser
        .replace_text(&payload, r#"{"tracking": "1Z9"}"#, SHORT)
        .await;
    browser
        .type_into(&format!("{wait} input.signal-id"), "dlv-1", SHORT)
        .await;
    browser.screenshot(&screenshot_path(&stack, "signal")).await;
    browser.click(&send, SHORT).await;
    let taken = browser
        .wait_text(
            "the signal's answer",
            "#run-messages .signal-answer",
            LONG,
            |t| !t.is_empty(),
        )
        .await;
    assert!(
        taken.starts_with("Signal laptop_delivered dlv-1: taken."),
        "{taken}"
    );
    browser
        .wait_for(
            "the run page to show succeeded",
            "#run-status [data-status='succeeded']",
            LONG,
        )
        .await;
    let lines = browser
        .wait_text("the signal's events", "#signals-list", SHORT, |t| {
            t.contains("signal laptop_delivered dlv-1 from user:alice")
        })
        .await;
    assert!(
        lines.contains("waiting for signal laptop_delivered at delivered until"),
        "{lines}"
    );
    assert!(browser.all(wait).await.is_empty(), "the wait is closed");

    let run = get_run(&client, &url, "hire-7").await;
    let welcome: Vec<_> = run["steps"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["node"] == "welcome")
        .collect();
    assert_eq!(welcome.len(), 1, "{run:#}");
    assert_eq!(welcome[0]["args"], json!({"tracking": "1Z9"}), "{run:#}");
    assert_eq!(run["open_waits"], json!([]), "{run:#}");
    let received = &run["waits"][0]["received"];
    assert_eq!(received[0]["signal_id"], "dlv-1", "{run:#}");
    assert_eq!(received.as_array().map(Vec::len), Some(1), "{run:#}");

    let errors = browser.console_errors().await;
    assert!(
        errors
            .iter()
            .all(|e| !e.contains("Content Security Policy")),
        "the console breaks its own policy: {errors:?}"
    );
}

/// An agent on the Anthropic API (the scripted fake model) that looks an order up and asks
/// to refund it, behind an approval.
fn agent_graph(model: &str) -> Value {
    json!({
        "id": "agent",
        "version": 1,
        "max_steps": 20,
        "nodes": [
            {
                "id": "assistant", "tool": "llm", "side_effect": "pure",
                "args": {"system": "Look the order up first.", "messages": [{"role": "user", "content": "$input.request"}]},
                "config": {"api": "anthropic", "base_url": format!("{model}/v1"), "model": "fake-agent"},
                "timeout": "10s",
                "may_request": ["lookup_order", "refund"],
                "tools": ["lookup_order", "refund"]
            },
            {"id": "lookup_order", "tool": "echo", "side_effect": "pure", "description": "Reads an order.",
             "args": {"order_id": "The order's id."}},
            {"id": "refund", "tool": "echo", "side_effect": "keyed",
             "args": {"order_id": "The order's id.", "amount": {"type": "number"}},
             "interrupt_before": {"reason": "Moves money.", "required_role": "approver", "timeout": "1h"}}
        ]
    })
}

/// The conversation, readable: the inbox shows the model message that asked for the call
/// being approved, and the run page shows the agent's conversation in order — what it was
/// told, each model answer and the tool it called, the approval as asked and decided, and
/// each tool's result; `sortie run get --conversation` prints the same.
///
/// Seen red with the fix reverted once: with `sortie_core::conversation::of` keeping a
/// decision only when it is not the final one (the quorum test inverted), the run page
/// showed the approval as requested and never as approved, and the order below did not
/// hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_conversation_reads_in_order_and_the_inbox_shows_the_asking_message() {
    let (fake, model_url) = sortie_tests::stack::serve_fake_model().await;
    let stack = Stack::start("console-agent", &[]).await;
    stack.publish(&agent_graph(&model_url).to_string()).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let (_gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), &[ALICE])
        .await;
    let client = reqwest::Client::new();
    let answer = client
        .post(format!("{url}/v1/runs"))
        .bearer_auth("tok-alice")
        .json(&json!({"graph_id": "agent", "run_id": "agent-1", "input": {"request": "refund order 7"}}))
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(answer.status().as_u16(), 201, "{:?}", answer.text().await);
    sortie_tests::wait_until("the run to wait for approval", LONG, || async {
        run_status(&client, &url, "agent-1").await == "waiting_approval"
    })
    .await;

    let browser = Browser::start(&stack.dir.join("chromedriver.log"), 1280, 1000).await;
    sign_in(&browser, &url, "tok-alice").await;
    let item = ".inbox-item[data-run-id='agent-1']";
    browser
        .wait_for("the refund in the inbox", item, LONG)
        .await;
    assert_eq!(
        browser
            .text(&format!("{item} .model-message .model-text"))
            .await
            .as_deref(),
        Some("I will call refund."),
        "the model message that asked for the call"
    );
    let call = browser
        .text(&format!("{item} .model-message .model-call"))
        .await
        .unwrap_or_default();
    assert!(
        call.starts_with("refund(") && call.contains("\"amount\":1"),
        "{call}"
    );
    assert_eq!(
        browser.text(&format!("{item} .on-reject")).await.as_deref(),
        Some("The call does not run; the model is told an approver rejected it, and goes on."),
        "a rejected tool call is told to the model; the run does not fail"
    );
    browser
        .screenshot(&screenshot_path(&stack, "inbox-agent"))
        .await;
    browser
        .click(&format!("{item} button.approve"), SHORT)
        .await;
    browser
        .wait_text(
            "the approval to be answered",
            "#inbox-flash .decided",
            LONG,
            |t| t.starts_with("Approved refund"),
        )
        .await;

    browser.goto(&format!("{url}/ui/#/runs/agent-1")).await;
    browser
        .wait_for(
            "the run page to show succeeded",
            "#run-status [data-status='succeeded']",
            LONG,
        )
        .await;
    browser
        .wait_text(
            "the conversation's last answer",
            "#conversation-list",
            LONG,
            |t| t.contains(sortie_devkit::model::FINAL_ANSWER),
        )
        .await;
    let turns = browser.all("#conversation-list > li").await.len();
    let mut read = Vec::new();
    for i in 1..=turns {
        let turn = format!("#conversation-list > li:nth-child({i})");
        let who = browser
            .text(&format!("{turn} .who"))
            .await
            .unwrap_or_default()
            .to_lowercase();
        let body = browser
            .text(&format!("{turn} .turn-body"))
            .await
            .unwrap_or_default();
        read.push(format!(
            "{who}: {}",
            body.lines().next().unwrap_or_default()
        ));
    }
    assert_eq!(
        read,
        [
            "system: Look the order up first.",
            "user: refund order 7",
            "model: I will call lookup_order.",
            "tool: lookup_order succeeded",
            "model: I will call refund.",
            "approval: refund requested",
            "approval: refund approved by user:alice",
            "tool: refund succeeded",
            &format!("model: {}", sortie_devkit::model::FINAL_ANSWER),
        ],
        "the conversation in order"
    );
    let result = browser
        .text("#conversation-list > li:nth-child(4) .result")
        .await
        .unwrap_or_default();
    assert_eq!(
        result, r#"{"order_id":"fake-order_id"}"#,
        "what the tool answered"
    );
    browser
        .screenshot(&screenshot_path(&stack, "conversation"))
        .await;
    assert!(
        browser.console_errors().await.is_empty(),
        "{:?}",
        browser.console_errors().await
    );

    // The CLI prints the same conversation.
    let printed = std::process::Command::new(sortie_tests::stack::sortie_bin())
        .args([
            "run",
            "--gateway",
            &url,
            "--token",
            "tok-alice",
            "get",
            "agent-1",
            "--conversation",
        ])
        .env("NO_COLOR", "1")
        .output()
        .expect("sortie run get");
    assert!(printed.status.success(), "{printed:?}");
    let text = String::from_utf8_lossy(&printed.stdout);
    let order = [
        "system",
        "user",
        "→ lookup_order(",
        "tool lookup_order",
        "→ refund(",
        "refund: requested",
        "refund: approved by user:alice",
        "tool refund",
        sortie_devkit::model::FINAL_ANSWER,
    ];
    let mut from = 0;
    for needle in order {
        let at = text[from..]
            .find(needle)
            .unwrap_or_else(|| panic!("{needle:?} after byte {from} of:\n{text}"));
        from += at + needle.len();
    }
    assert_eq!(fake.exchanges().len(), 3);
}

/// A parent's run page lists its child runs with links, and a child's page links its
/// parent: a person follows a sub-agent and back. Seen red with the console's
/// `#run-children` list left out of the run page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_run_page_links_its_child_and_the_child_its_parent() {
    let child = "id: waiter\nversion: 1\nnodes:\n  - id: go\n    wait: {signal: go, timeout: 1h}\n";
    let parent =
        "id: boss\nversion: 1\nnodes:\n  - {id: delegate, run: {graph: waiter}, args: {}}\n";
    let stack = Stack::start("console-children", &[child, parent]).await;
    let _reducer = stack.reducer("0");
    let (_gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), &[ALICE])
        .await;
    let client = reqwest::Client::new();
    let answer = client
        .post(format!("{url}/v1/runs"))
        .bearer_auth("tok-alice")
        .json(&json!({"graph_id": "boss", "run_id": "boss-7", "input": {}}))
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(answer.status().as_u16(), 201, "{:?}", answer.text().await);
    let child_id = sortie_tests::wait_for("the child to start", LONG, || async {
        let run = get_run(&client, &url, "boss-7").await;
        let id = run["children"][0]["run_id"].as_str()?.to_owned();
        (run_status(&client, &url, &id).await == "waiting_signal").then_some(id)
    })
    .await;

    let browser = Browser::start(&stack.dir.join("chromedriver.log"), 1280, 1000).await;
    sign_in(&browser, &url, "tok-alice").await;
    browser.goto(&format!("{url}/ui/#/runs/boss-7")).await;
    let listed = browser
        .wait_text("the child run listed", "#run-children", LONG, |t| {
            t.contains(&child_id)
        })
        .await;
    assert!(listed.contains("delegate"), "{listed}");
    browser.click("#run-children a", SHORT).await;
    let parent_fact = browser
        .wait_text(
            "the child's page names its parent",
            "#run-parent",
            LONG,
            |t| t.contains("boss-7"),
        )
        .await;
    assert!(parent_fact.contains("delegate#1"), "{parent_fact}");
    browser
        .wait_for(
            "the child's page shows it waits",
            "#run-status [data-status='waiting_signal']",
            LONG,
        )
        .await;
}

/// A conversation on the fake model (OpenAI chat completions, no tools: every answer is
/// text): the person talks with `chat` turn after turn; `close` echoes how it ended and
/// after how many turns. With `roles`, only a principal holding one may send a message.
fn chat_graph(id: &str, model: &str, roles: &[&str]) -> Value {
    let mut conversation = json!({"signal": "message", "max_turns": 10});
    if !roles.is_empty() {
        conversation["roles"] = json!(roles);
    }
    json!({
        "id": id,
        "version": 1,
        "max_steps": 20,
        "nodes": [
            {
                "id": "chat", "tool": "llm", "side_effect": "pure",
                "args": {"messages": [{"role": "user", "content": "$input.question"}], "temperature": 0},
                "config": {"base_url": format!("{model}/v1"), "model": "fake-agent"},
                "timeout": "10s",
                "conversation": conversation
            },
            {
                "id": "close", "tool": "echo", "side_effect": "pure",
                "args": {"ended_by": "$steps.chat.output.ended_by", "turns": "$steps.chat.output.turns"}
            }
        ],
        "edges": [{"from": "chat", "to": "close"}]
    })
}

/// A person talks with a conversation from its run page: the open wait for the next
/// message is a message box (not the JSON form) showing the model's last answer; an empty
/// message is refused in the page and not sent; a message is taken, the model answers it
/// and the conversation section reads the person's message between the two answers; "End
/// conversation" ends it, and the step after the conversation sees it ended by the person
/// after 2 turns (checked on the HTTP API). On a conversation whose messages need a role
/// she does not hold, the box shows the gateway's refusal.
///
/// The executor and gateway run with a blob store: a conversation keeps its transcript
/// there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_person_talks_with_a_conversation_from_its_run_page() {
    use sortie_devkit::model::{FINAL_ANSWER, REPLY};
    let (fake, model_url) = sortie_tests::stack::serve_fake_model().await;
    let stack = Stack::start("console-talk", &[]).await;
    stack
        .publish(&chat_graph("talk", &model_url, &[]).to_string())
        .await;
    stack
        .publish(&chat_graph("guarded_talk", &model_url, &["customer"]).to_string())
        .await;
    let blobs = stack.dir.join("blobs");
    std::fs::create_dir_all(&blobs).expect("blob dir");
    let store = format!("file://{}", blobs.display());
    let _reducer = stack.reducer("0");
    let _executor = stack.executor_process("executor", &["default"], &["--blob-store", &store]);
    let (_gateway, url) = stack
        .gateway_process_with(
            &stack.dir.join("gateway"),
            &[ALICE],
            &["--blob-store", &store],
        )
        .await;
    let client = reqwest::Client::new();
    let start = |graph: &'static str, run_id: &'static str| {
        let client = client.clone();
        let url = url.clone();
        async move {
            let answer = client
                .post(format!("{url}/v1/runs"))
                .bearer_auth("tok-alice")
                .json(&json!({"graph_id": graph, "run_id": run_id, "input": {"question": "Hello"}}))
                .send()
                .await
                .expect("the gateway answers");
            assert_eq!(answer.status().as_u16(), 201, "{:?}", answer.text().await);
            sortie_tests::wait_until("the conversation to wait for a message", LONG, || async {
                run_status(&client, &url, run_id).await == "waiting_signal"
            })
            .await;
            let run = get_run(&client, &url, run_id).await;
            assert_eq!(run["open_waits"], json!(["message"]), "{run:#}");
            let open: Vec<_> = run["waits"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|w| w["status"] == "open")
                .collect();
            assert_eq!(open.len(), 1, "{run:#}");
            assert_eq!(open[0]["conversation"], true, "{run:#}");
        }
    };
    start("talk", "talk-1").await;

    let browser = Browser::start(&stack.dir.join("chromedriver.log"), 1280, 1000).await;
    sign_in(&browser, &url, "tok-alice").await;
    browser.goto(&format!("{url}/ui/#/runs/talk-1")).await;
    let card = "#run-waits .conversation-wait[data-signal='message']";
    let text = format!("{card} textarea.message-text");
    let send = format!("{card} button.send-message");
    let shown = browser
        .wait_text("the message box", card, LONG, |t| t.contains(FINAL_ANSWER))
        .await;
    assert!(
        shown.contains("Your message") && shown.contains("End conversation"),
        "{shown}"
    );
    assert!(
        browser.all("#run-waits .signal-form").await.is_empty(),
        "a conversation's wait has no JSON payload form"
    );

    // An empty message: said in the page, nothing sent.
    browser.click(&send, SHORT).await;
    let refused = browser
        .wait_text(
            "the empty message to be refused",
            &format!("{card} .message-result .message-refusal.code-empty"),
            SHORT,
            |t| !t.is_empty(),
        )
        .await;
    assert!(refused.contains("empty"), "{refused}");
    assert_eq!(run_status(&client, &url, "talk-1").await, "waiting_signal");
    assert_eq!(
        fake.exchanges().len(),
        1,
        "the model answered the opening only"
    );

    browser.type_into(&text, "Where is order 7?", SHORT).await;
    assert!(
        browser.all(&format!("{card} .code-empty")).await.is_empty(),
        "writing clears the empty message's refusal"
    );
    browser
        .screenshot(&screenshot_path(&stack, "message-box"))
        .await;
    browser.click(&send, SHORT).await;
    let taken = browser
        .wait_text(
            "the message's answer (or a refusal)",
            &format!("#run-messages .message-answer, {card} .message-refusal"),
            LONG,
            |t| !t.is_empty(),
        )
        .await;
    assert!(taken.starts_with("Your message was taken"), "{taken}");
    let said = format!("{REPLY}Where is order 7?");
    browser
        .wait_text("the model's reply", "#conversation-list", LONG, |t| {
            t.contains(&said)
        })
        .await;
    // The next turn's box shows the reply, empty and ready.
    browser
        .wait_text("the next turn's box", card, LONG, |t| t.contains(&said))
        .await;
    let turns = browser.all("#conversation-list > li").await.len();
    let mut read = Vec::new();
    for i in 1..=turns {
        let turn = format!("#conversation-list > li:nth-child({i})");
        let who = browser
            .text(&format!("{turn} .who"))
            .await
            .unwrap_or_default()
            .to_lowercase();
        let body = browser
            .text(&format!("{turn} .turn-body"))
            .await
            .unwrap_or_default();
        read.push(format!(
            "{who}: {}",
            body.lines().next().unwrap_or_default()
        ));
    }
    assert_eq!(
        read,
        [
            "user: Hello".to_owned(),
            format!("model: {FINAL_ANSWER}"),
            "user: Where is order 7?".to_owned(),
            format!("model: {said}"),
        ],
        "the conversation in order"
    );
    browser
        .wait_text("the message's signal", "#signals-list", SHORT, |t| {
            t.contains("signal message msg-")
        })
        .await;
    browser
        .screenshot(&screenshot_path(&stack, "conversation-turns"))
        .await;

    browser
        .click(&format!("{card} button.end-conversation"), SHORT)
        .await;
    sortie_tests::wait_until(
        "the conversation to end and the run to succeed",
        LONG,
        || async { run_status(&client, &url, "talk-1").await == "succeeded" },
    )
    .await;
    let run = get_run(&client, &url, "talk-1").await;
    let close: Vec<_> = run["steps"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["node"] == "close")
        .collect();
    assert_eq!(close.len(), 1, "{run:#}");
    assert_eq!(
        close[0]["args"],
        json!({"ended_by": "person", "turns": 2}),
        "{run:#}"
    );
    assert_eq!(run["open_waits"], json!([]), "{run:#}");
    browser
        .wait_for(
            "the run page to show succeeded",
            "#run-status [data-status='succeeded']",
            LONG,
        )
        .await;
    browser
        .wait_text(
            "the end in the conversation",
            "#conversation-list",
            LONG,
            |t| t.contains("(ends the conversation)"),
        )
        .await;
    assert!(
        browser.all(card).await.is_empty(),
        "the message box is gone"
    );
    assert_eq!(fake.exchanges().len(), 2, "ending calls the model no more");
    let second = fake.exchanges()[1].request["messages"].to_string();
    assert!(
        second.contains(FINAL_ANSWER) && second.contains("Where is order 7?"),
        "the model saw the conversation so far: {second}"
    );

    // A conversation whose messages need the role `customer`: the box shows the refusal.
    start("guarded_talk", "talk-2").await;
    browser.goto(&format!("{url}/ui/#/runs/talk-2")).await;
    browser
        .wait_text("the guarded message box", card, LONG, |t| {
            t.contains(FINAL_ANSWER)
        })
        .await;
    browser.type_into(&text, "Hi", SHORT).await;
    browser.click(&send, SHORT).await;
    let refused = browser
        .wait_text(
            "the role's refusal",
            &format!("{card} .message-result .message-refusal"),
            LONG,
            |t| !t.is_empty(),
        )
        .await;
    assert!(
        refused.starts_with("Not sent (forbidden)") && refused.contains("customer"),
        "{refused}"
    );
    assert_eq!(
        browser
            .all(&format!("{card} button.send-message:disabled"))
            .await
            .len(),
        0,
        "the buttons work again after the refusal"
    );
    assert_eq!(run_status(&client, &url, "talk-2").await, "waiting_signal");

    let errors = browser.console_errors().await;
    assert!(
        errors
            .iter()
            .all(|e| !e.contains("Content Security Policy")),
        "the console breaks its own policy: {errors:?}"
    );
}

/// A model's answer grows on the run page while the model writes it (the run's `delta`
/// events), and gives way to the recorded answer once the step's result arrives: a
/// conversation whose model streams slowly (`fake-agent-slow`, 200 ms a word) is sent a
/// 40-word message, and the page shows part of the reply, then all of it in the
/// conversation, with nothing left "writing".
///
/// Seen red with the console's delta handler left out (`onDelta` not passed): the page
/// never showed the partial reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_models_answer_grows_on_the_run_page_as_it_is_written() {
    let (_fake, model_url) = sortie_tests::stack::serve_fake_model().await;
    let stack = Stack::start("console-stream", &[]).await;
    let mut graph = chat_graph("slow_talk", &model_url, &[]);
    graph["nodes"][0]["config"]["model"] = json!("fake-agent-slow");
    graph["nodes"][0]["timeout"] = json!("60s");
    stack.publish(&graph.to_string()).await;
    let blobs = stack.dir.join("blobs");
    std::fs::create_dir_all(&blobs).expect("blob dir");
    let store = format!("file://{}", blobs.display());
    let _reducer = stack.reducer("0");
    let _executor = stack.executor_process("executor", &["default"], &["--blob-store", &store]);
    let (_gateway, url) = stack
        .gateway_process_with(
            &stack.dir.join("gateway"),
            &[ALICE],
            &["--blob-store", &store],
        )
        .await;
    let client = reqwest::Client::new();
    let answer = client
        .post(format!("{url}/v1/runs"))
        .bearer_auth("tok-alice")
        .json(&json!({"graph_id": "slow_talk", "run_id": "slow-1", "input": {"question": "Hello"}}))
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(answer.status().as_u16(), 201);
    sortie_tests::wait_until("the conversation to wait for a message", LONG, || async {
        run_status(&client, &url, "slow-1").await == "waiting_signal"
    })
    .await;

    let browser = Browser::start(&stack.dir.join("chromedriver.log"), 1280, 1000).await;
    sign_in(&browser, &url, "tok-alice").await;
    browser.goto(&format!("{url}/ui/#/runs/slow-1")).await;
    browser
        .wait_for("the run page", "#run-waits .conversation-wait", LONG)
        .await;
    let message: String = (1..=40).map(|n| format!("word{n} ")).collect();
    let message = message.trim_end().to_owned();
    let sent = client
        .post(format!("{url}/v1/runs/slow-1/signals/message"))
        .bearer_auth("tok-alice")
        .json(&json!({"payload": {"text": message}}))
        .send()
        .await
        .expect("the gateway answers");
    assert!(sent.status().is_success(), "{:?}", sent.text().await);

    let partial = browser
        .wait_text(
            "part of the reply, being written",
            "#run-writing .writing-text",
            LONG,
            |t| t.contains("word3") && !t.contains("word40"),
        )
        .await;
    assert!(partial.starts_with("You said:"), "{partial}");
    browser
        .wait_text(
            "the whole reply in the conversation",
            "#run-conversation",
            LONG,
            |t| t.contains("word40"),
        )
        .await;
    sortie_tests::wait_until("nothing left writing", LONG, || async {
        browser.all("#run-writing .writing").await.is_empty()
    })
    .await;
    assert!(browser.console_errors().await.is_empty());
}
