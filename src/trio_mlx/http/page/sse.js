// Server-sent events read from a fetch response's body (a ReadableStream of bytes).
//
// `readEvents(body)` yields each event as {event, data}: `data` is its `data:` lines joined with
// newlines, `event` its `event:` name ("message" when it has none); comment lines (": ping") and
// events without data are skipped. It ends when the body ends (a caller that stops iterating
// early cancels the rest of the body); aborting the fetch (its
// AbortController) makes the pending read, and so the iteration, throw an AbortError.

export async function* readEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let finished = false;
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) {
        finished = true;
        break;
      }
      buffer += value;
      let end;
      while ((end = eventEnd(buffer)) !== null) {
        const event = parseEvent(buffer.slice(0, end.at));
        buffer = buffer.slice(end.at + end.length);
        if (event) yield event;
      }
    }
    const last = parseEvent(buffer);
    if (last) yield last;
  } finally {
    // Left early (the caller stopped at [DONE] or an error): stop reading the body.
    if (!finished) await reader.cancel().catch(() => {});
  }
}

// Where the first complete event of `buffer` ends (a blank line: \n\n, \r\n\r\n or \r\r).
function eventEnd(buffer) {
  const match = /\r\n\r\n|\n\n|\r\r/.exec(buffer);
  return match ? { at: match.index, length: match[0].length } : null;
}

function parseEvent(block) {
  const data = [];
  let event = "message";
  for (const line of block.split(/\r\n|\n|\r/)) {
    if (line === "" || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") data.push(value);
    else if (field === "event") event = value;
  }
  return data.length ? { event, data: data.join("\n") } : null;
}
