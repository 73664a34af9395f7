//! OpenAI chat completions: the script's answer in that API, and the answer as the
//! `chat.completion.chunk`s it streams.

use serde_json::{json, Value};

use super::stream::{data, pieces, words, Sent};
use super::{arguments, prompt_tokens, Exchange, FakeModel, Turn, COMPLETION_TOKENS};

impl FakeModel {
    /// The answer to one request (the script), with the exchange recorded.
    pub fn answer(&self, request: &Value) -> Result<Value, String> {
        let messages = request
            .get("messages")
            .and_then(Value::as_array)
            .ok_or("messages must be an array")?;
        let tools = request
            .get("tools")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let turn = Turn::of(messages);
        let answered = messages[turn.since..]
            .iter()
            .filter(|m| m["role"] == "tool")
            .count();
        let (tools, stop) = turn.tools(tools, |t| &t["function"]["name"]);
        let pick = match stop {
            Some(stop) if turn.goodbye() && answered == 0 => Some(stop),
            _ => tools.get(answered).filter(|_| answered < 2).cloned(),
        };
        let message = match pick {
            Some(tool) => {
                let name = tool["function"]["name"].as_str().unwrap_or_default();
                let arguments = arguments(&tool["function"]["parameters"]);
                json!({
                    "role": "assistant",
                    "content": null,
                    "tool_calls": [{
                        "id": format!("call_{}_{name}", answered + 1),
                        "type": "function",
                        "function": {"name": name, "arguments": arguments.to_string()},
                    }],
                })
            }
            None => json!({"role": "assistant", "content": turn.answer()}),
        };
        let prompt_tokens = prompt_tokens(request);
        let usage = json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": COMPLETION_TOKENS,
            "total_tokens": prompt_tokens + COMPLETION_TOKENS,
        });
        let finish_reason = if message.get("tool_calls").is_some() {
            "tool_calls"
        } else {
            "stop"
        };
        let model = request.get("model").cloned().unwrap_or(json!("fake"));
        if let Ok(mut exchanges) = self.exchanges.lock() {
            exchanges.push(Exchange {
                request: request.clone(),
                usage: usage.clone(),
                message: message.clone(),
            });
        }
        Ok(json!({
            "id": format!("chatcmpl-fake-{}", self.exchanges().len()),
            "object": "chat.completion",
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": usage,
        }))
    }
}

/// An OpenAI answer as a stream of `chat.completion.chunk`s.
pub(super) fn openai_events(answer: &Value, include_usage: bool) -> Vec<Sent> {
    let chunk = |choices: Value| {
        json!({
            "id": answer["id"],
            "object": "chat.completion.chunk",
            "model": answer["model"],
            "choices": choices,
        })
    };
    let delta = |delta: Value| chunk(json!([{"index": 0, "delta": delta, "finish_reason": null}]));
    let choice = &answer["choices"][0];
    let message = &choice["message"];
    let calls = message["tool_calls"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let opening = if calls.is_empty() {
        json!("")
    } else {
        Value::Null
    };
    let mut sent = vec![data(
        false,
        &delta(json!({"role": "assistant", "content": opening})),
    )];
    for word in words(message["content"].as_str().unwrap_or_default()) {
        sent.push(data(true, &delta(json!({"content": word}))));
    }
    for (index, call) in calls.iter().enumerate() {
        sent.push(data(
            true,
            &delta(json!({"tool_calls": [{
                "index": index,
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            }]})),
        ));
        let arguments = call["function"]["arguments"].as_str().unwrap_or_default();
        for piece in pieces(arguments, 8) {
            sent.push(data(
                true,
                &delta(json!({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})),
            ));
        }
    }
    sent.push(data(
        false,
        &chunk(json!([{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}])),
    ));
    if include_usage {
        let mut last = chunk(json!([]));
        last["usage"] = answer["usage"].clone();
        sent.push(data(false, &last));
    }
    sent.push(Sent {
        delta: false,
        text: "data: [DONE]\n\n".into(),
    });
    sent
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::super::stream::tests::data_of;
    use super::super::tests::tool;
    use super::super::FINAL_ANSWER;
    use super::*;

    #[test]
    fn a_streamed_openai_answer_is_the_same_script_in_chunks() {
        let model = FakeModel::default();
        let mut request = json!({
            "model": "fake",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool("a"), tool("b")],
        });
        let unstreamed = model.answer(&request).unwrap();
        request["stream"] = json!(true);
        request["stream_options"] = json!({"include_usage": true});
        let answer = model.answer(&request).unwrap();
        assert_eq!(
            answer["usage"], unstreamed["usage"],
            "usage ignores streaming"
        );
        assert_eq!(model.exchanges()[0].usage, model.exchanges()[1].usage);
        let chunks = data_of(&openai_events(&answer, true));
        assert_eq!(chunks.last().map(String::as_str), Some("[DONE]"));
        let chunks: Vec<Value> = chunks[..chunks.len() - 1]
            .iter()
            .map(|c| serde_json::from_str(c).unwrap())
            .collect();
        let arguments: String = chunks
            .iter()
            .filter_map(|c| {
                c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str()
            })
            .collect();
        let call = &answer["choices"][0]["message"]["tool_calls"][0];
        assert_eq!(arguments, call["function"]["arguments"].as_str().unwrap());
        assert!(
            chunks
                .iter()
                .filter(|c| c["choices"][0]["delta"]["tool_calls"].is_array())
                .count()
                > 2
        );
        assert_eq!(
            chunks[1]["choices"][0]["delta"]["tool_calls"][0]["id"],
            call["id"]
        );
        let last = chunks.last().unwrap();
        assert_eq!(last["usage"], answer["usage"]);
        assert_eq!(last["choices"], json!([]));
        // No usage chunk unless asked for; a text answer a delta per word.
        let text = json!({"model": "m", "choices": [{"index": 0, "finish_reason": "stop",
                          "message": {"role": "assistant", "content": FINAL_ANSWER}}]});
        let chunks: Vec<Value> = data_of(&openai_events(&text, false))
            .iter()
            .filter_map(|c| serde_json::from_str(c).ok())
            .collect();
        assert!(chunks.iter().all(|c| c.get("usage").is_none()));
        let said: Vec<&str> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(said, ["", "Done:", " both", " tools", " answered."]);
    }
}
