//! The gateway under hostile input (issue #40), as its own process over real HTTP with a
//! real reducer: two tenants racing one run id and idempotency key each get their own
//! answer.

use serde_json::{json, Value};
use sortie_tests::stack::{succeed, Stack};

const THREE_STEPS: &str = r#"
id: three
version: 1
nodes:
  - {id: fetch, tool: echo, side_effect: pure, args: {order: $input.order}}
  - {id: price, tool: echo, side_effect: idempotent, args: {from: $steps.fetch.output.step}}
  - {id: notify, tool: echo, side_effect: keyed, args: {from: $steps.price.output.step}}
edges:
  - {from: fetch, to: price}
  - {from: price, to: notify}
"#;

const TOKENS: &[&str] = &["acme:user:bob::tok-bob", "globex:user:eve::tok-eve"];

/// A small HTTP client for one gateway.
struct Api {
    client: reqwest::Client,
    base: String,
}

impl Api {
    fn new(base: &str) -> Api {
        Api {
            client: reqwest::Client::new(),
            base: base.to_owned(),
        }
    }

    fn request(&self, method: &str, path: &str, token: &str) -> reqwest::RequestBuilder {
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
        self.client
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(token)
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> (u16, Value) {
        let response = request.send().await.expect("the gateway answers");
        let status = response.status().as_u16();
        let text = response.text().await.expect("a body");
        let body = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("status {status}: the body is not JSON ({e}): {text}"));
        (status, body)
    }

    async fn get(&self, path: &str, token: &str) -> (u16, Value) {
        self.send(self.request("GET", path, token)).await
    }
}

fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or_default()
}

/// Two tenants racing one client-chosen run id and idempotency key: the reducer accepts one
/// and refuses the other (`run_id_unavailable`), and each client gets its own tenant's
/// answer. Answers matched on command id and run id only, so whichever came first went to
/// both waiters.
///
/// Seen red: with the tenant left out of `View::answer`'s match, rounds answered 201 to
/// both tenants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenants_racing_one_run_id_and_key_each_get_their_own_answer() {
    let stack = Stack::start("gateway-race", &[THREE_STEPS]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let (_gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), TOKENS)
        .await;
    let api = Api::new(&url);
    for round in 0..8 {
        let start = |token: &str| {
            api.send(
                api.request("POST", "/v1/runs", token)
                    .header(sortie_gateway::IDEMPOTENCY_HEADER, format!("key-{round}"))
                    .json(&json!({"graph_id": "three", "run_id": format!("shared-{round}"), "input": {}})),
            )
        };
        let ((bob, bobs), (eve, eves)) = tokio::join!(start("tok-bob"), start("tok-eve"));
        let mut statuses = [bob, eve];
        statuses.sort();
        assert_eq!(statuses, [201, 409], "round {round}: {bobs} / {eves}");
        let refused = if bob == 409 { &bobs } else { &eves };
        assert_eq!(code(refused), "run_id_unavailable", "{refused}");
        // The winner owns the run; the loser cannot see it.
        let (owner, other) = if bob == 201 {
            ("tok-bob", "tok-eve")
        } else {
            ("tok-eve", "tok-bob")
        };
        let position = if bob == 201 { &bobs } else { &eves }["position"]
            .as_str()
            .expect("position")
            .to_owned();
        let path = format!("/v1/runs/shared-{round}?min_position={position}");
        assert_eq!(api.get(&path, owner).await.0, 200);
        assert_eq!(api.get(&path, other).await.0, 404);
    }
}
