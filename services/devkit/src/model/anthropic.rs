//! Anthropic Messages: the script's answer in that API (tool calls as `tool_use` blocks),
//! and the answer as the events the Messages API streams.

use serde_json::{json, Value};

use super::stream::{event, pieces, words, Sent};
use super::{arguments, prompt_tokens, Exchange, FakeModel, Turn, COMPLETION_TOKENS};

impl FakeModel {
    /// The answer to one Anthropic Messages request (the same script), recorded.
    pub fn answer_anthropic(&self, request: &Value) -> Result<Value, String> {
        let messages = request
            .get("messages")
            .and_then(Value::as_array)
            .ok_or("messages must be an array")?;
        if request.get("max_tokens").and_then(Value::as_u64).is_none() {
            return Err("max_tokens is required".into());
        }
        let tools = request
            .get("tools")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let turn = Turn::of(messages);
        let answered = messages[turn.since..]
            .iter()
            .filter(|m| m["role"] == "user")
            .filter_map(|m| m["content"].as_array())
            .flatten()
            .filter(|b| b["type"] == "tool_result")
            .count();
        let (tools, stop) = turn.tools(tools, |t| &t["name"]);
        let pick = match stop {
            Some(stop) if turn.goodbye() && answered == 0 => Some(stop),
            _ => tools.get(answered).filter(|_| answered < 2).cloned(),
        };
        let (content, stop_reason) = match pick {
            Some(tool) => {
                let name = tool["name"].as_str().unwrap_or_default();
                let input = arguments(&tool["input_schema"]);
                (
                    json!([
                        {"type": "text", "text": format!("I will call {name}.")},
                        {"type": "tool_use", "id": format!("toolu_{}_{name}", answered + 1), "name": name, "input": input},
                    ]),
                    "tool_use",
                )
            }
            None => (json!([{"type": "text", "text": turn.answer()}]), "end_turn"),
        };
        let input_tokens = prompt_tokens(request);
        let usage = json!({"input_tokens": input_tokens, "output_tokens": COMPLETION_TOKENS});
        let message = json!({"role": "assistant", "content": content});
        if let Ok(mut exchanges) = self.exchanges.lock() {
            exchanges.push(Exchange {
                request: request.clone(),
                usage: usage.clone(),
                message: message.clone(),
            });
        }
        Ok(json!({
            "id": format!("msg_fake_{}", self.exchanges().len()),
            "type": "message",
            "role": "assistant",
            "model": request.get("model").cloned().unwrap_or(json!("fake")),
            "content": content,
            "stop_reason": stop_reason,
            "usage": usage,
        }))
    }
}

/// An Anthropic answer as the Messages API streams it.
pub(super) fn anthropic_events(answer: &Value) -> Vec<Sent> {
    let mut started = answer.clone();
    started["content"] = json!([]);
    started["stop_reason"] = Value::Null;
    started["stop_sequence"] = Value::Null;
    started["usage"]["output_tokens"] = json!(1);
    let mut sent = vec![
        event(false, &json!({"type": "message_start", "message": started})),
        event(false, &json!({"type": "ping"})),
    ];
    let blocks = answer["content"].as_array().cloned().unwrap_or_default();
    for (index, block) in blocks.iter().enumerate() {
        let mut opened = block.clone();
        let deltas: Vec<Value> = if block["type"] == "tool_use" {
            opened["input"] = json!({});
            let input = block["input"].to_string();
            std::iter::once(String::new())
                .chain(pieces(&input, 8))
                .map(|piece| json!({"type": "input_json_delta", "partial_json": piece}))
                .collect()
        } else {
            opened["text"] = json!("");
            words(block["text"].as_str().unwrap_or_default())
                .into_iter()
                .map(|word| json!({"type": "text_delta", "text": word}))
                .collect()
        };
        sent.push(event(
            false,
            &json!({"type": "content_block_start", "index": index, "content_block": opened}),
        ));
        for delta in deltas {
            sent.push(event(
                true,
                &json!({"type": "content_block_delta", "index": index, "delta": delta}),
            ));
        }
        sent.push(event(
            false,
            &json!({"type": "content_block_stop", "index": index}),
        ));
    }
    sent.push(event(
        false,
        &json!({
            "type": "message_delta",
            "delta": {"stop_reason": answer["stop_reason"], "stop_sequence": null},
            "usage": {"output_tokens": answer["usage"]["output_tokens"]},
        }),
    ));
    sent.push(event(false, &json!({"type": "message_stop"})));
    sent
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::super::stream::tests::data_of;
    use super::*;

    #[test]
    fn a_streamed_anthropic_answer_is_the_same_script_in_events() {
        let model = FakeModel::default();
        let request = json!({
            "model": "fake",
            "max_tokens": 100,
            "stream": true,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "a", "input_schema": {"type": "object",
                       "properties": {"order_id": {"type": "string"}}}}],
        });
        let answer = model.answer_anthropic(&request).unwrap();
        let sent = anthropic_events(&answer);
        let names: Vec<&str> = sent
            .iter()
            .filter_map(|s| s.text.lines().next()?.strip_prefix("event: "))
            .collect();
        assert_eq!(names.first(), Some(&"message_start"));
        assert_eq!(names.last(), Some(&"message_stop"));
        let events: Vec<Value> = data_of(&sent)
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let text: String = events
            .iter()
            .filter_map(|e| e["delta"]["text"].as_str())
            .collect();
        assert_eq!(text, "I will call a.");
        let input: String = events
            .iter()
            .filter_map(|e| e["delta"]["partial_json"].as_str())
            .collect();
        assert_eq!(
            serde_json::from_str::<Value>(&input).unwrap(),
            answer["content"][1]["input"]
        );
        assert_eq!(
            events[0]["message"]["usage"]["input_tokens"],
            answer["usage"]["input_tokens"]
        );
        let delta = &events[events.len() - 2];
        assert_eq!(delta["delta"]["stop_reason"], "tool_use");
        assert_eq!(delta["usage"]["output_tokens"], COMPLETION_TOKENS);
        assert!(sent.iter().filter(|s| s.delta).count() > 4);
    }
}
