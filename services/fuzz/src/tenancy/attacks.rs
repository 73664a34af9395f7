//! The attacker's moves: runs and commands over Kafka signed by its service key (its own
//! tenant's, or forged as the victim's), its tokens on a victim's run over HTTP, and slow
//! sockets held on the gateway.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Instant;

use rdkafka::producer::FutureProducer;
use serde_json::{json, Value};
use sortie_wire::records as w;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpSocket, TcpStream};

use super::{clip, remember, Report, Target, ATTACKER_MARK};
use crate::produce::send;

/// A command of the attacker's (tenant `tenant`), signed by its service key.
async fn send_command(
    target: &Target,
    producer: &FutureProducer,
    run_id: &str,
    tenant: &str,
    body: w::CommandBody,
) -> anyhow::Result<()> {
    let (signer, principal) = &target.attacker.signer;
    let command = w::RunCommand {
        command_id: format!(
            "atk-cmd-{}",
            sortie_core::blob::sha256_hex(format!("{run_id}{:?}", Instant::now()).as_bytes())
        ),
        tenant: tenant.to_owned(),
        run_id: run_id.to_owned(),
        issuer: w::Issuer {
            principal: principal.clone(),
            roles: vec!["approver".into(), "operator".into(), "finance".into()],
            groups: vec![],
        },
        issued_at: sortie_kafka::clock::now_ms(),
        body,
    };
    let topic = target.topics.commands();
    let value = target.codec.encode(&topic, &command).await?;
    let partition = sortie_wire::partition_for(run_id.as_bytes(), target.partitions);
    send(producer, &topic, run_id, Some(partition), &value, signer).await
}

pub(super) async fn start_signed(
    target: &Target,
    producer: &FutureProducer,
    run_id: &str,
    graph_id: &str,
    input: &Value,
) -> anyhow::Result<()> {
    let body = w::CommandBody::StartRun(w::StartRun {
        graph_id: graph_id.to_owned(),
        graph_version: None,
        input: input.to_string(),
        labels: BTreeMap::new(),
        budget: None,
        fork: None,
        parent: None,
    });
    send_command(target, producer, run_id, &target.attacker.tenant, body).await
}

/// One command of the attacker's about a victim's run: as itself (its own tenant), or
/// `forged`, claiming the victim's tenant with a key that may not sign for it.
pub(super) async fn cross_command(
    target: &Target,
    producer: &FutureProducer,
    run: &str,
    which: usize,
    forged: bool,
) -> anyhow::Result<()> {
    let body = match which {
        0 => w::CommandBody::CancelRun(w::CancelRun {
            reason: Some(ATTACKER_MARK.into()),
        }),
        1 => w::CommandBody::ResumeRun(w::ResumeRun {
            interrupt_id: "int_guess".into(),
            proposal_hash: "guess".into(),
            decision: w::Decision::Approve,
            payload: Some(json!({"raise": {"tokens": 1_000_000_000}}).to_string()),
            comment: None,
            edited_args: None,
            payload_is_input: true,
        }),
        2 => w::CommandBody::SignalRun(w::SignalRun {
            name: "go".into(),
            signal_id: None,
            payload: Some(json!({"mark": ATTACKER_MARK}).to_string()),
        }),
        3 => w::CommandBody::ReconcileOperation(w::ReconcileOperation {
            operation_id: "op_guess".into(),
            outcome: w::ReconcileOutcome::Failed,
            output: None,
            error: Some(ATTACKER_MARK.into()),
        }),
        _ => w::CommandBody::ForgetRun(w::ForgetRun {
            reason: Some(ATTACKER_MARK.into()),
        }),
    };
    let tenant = if forged {
        target.victim.tenant.clone()
    } else {
        target.attacker.tenant.clone()
    };
    send_command(target, producer, run, &tenant, body).await
}

/// The attacker's token on every route of a victim's run; each answer is kept for the
/// oracle, and a success is a problem.
pub(super) async fn cross_http(
    target: &Target,
    http: &reqwest::Client,
    token: &str,
    run: &str,
    answers: &Mutex<Vec<String>>,
    report: &mut Report,
) {
    let base = format!("{}/v1/runs/{run}", target.gateway_url);
    let requests = [
        http.get(&base),
        http.get(format!("{base}/events?follow=false")),
        http.get(format!("{base}/conversation")),
        http.get(format!("{base}/checkpoints")),
        http.post(format!("{base}/cancel"))
            .json(&json!({"reason": ATTACKER_MARK})),
        http.post(format!("{base}/fork"))
            .json(&json!({"at_version": 1})),
        http.delete(&base),
    ];
    for request in requests {
        let Ok(answer) = request.bearer_auth(token).send().await else {
            continue;
        };
        let status = answer.status();
        let text = answer.text().await.unwrap_or_default();
        *report
            .refusals
            .entry(format!("http:{}", status.as_u16()))
            .or_default() += 1;
        if status.is_success() {
            report.problems.push(format!(
                "the attacker's token got {status} on a victim's run {run}: {}",
                clip(&text)
            ));
        }
        remember(answers, &text);
    }
}

/// Sockets that send half a request and wait, from 127.0.0.3 and up.
pub(super) async fn slow_sockets(gateway: &str, count: usize) -> Vec<TcpStream> {
    let Some(addr) = gateway
        .strip_prefix("http://")
        .and_then(|a| a.parse::<SocketAddr>().ok())
    else {
        return Vec::new();
    };
    let mut sockets = Vec::new();
    for i in 0..count {
        let source = std::net::Ipv4Addr::new(127, 0, (3 + i / 250) as u8, (1 + i % 250) as u8);
        let Ok(socket) = TcpSocket::new_v4() else {
            continue;
        };
        if socket.bind(SocketAddr::new(source.into(), 0)).is_err() {
            continue;
        }
        if let Ok(mut stream) = socket.connect(addr).await {
            let _ = stream
                .write_all(b"POST /v1/runs HTTP/1.1\r\nHost: x\r\n")
                .await;
            sockets.push(stream);
        }
    }
    sockets
}
