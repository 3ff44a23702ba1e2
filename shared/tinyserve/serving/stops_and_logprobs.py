"""What a choice's streamed text goes through on its way out: stop strings
(``StopStrings``, which never lets part of one out) and log-probabilities in
both of OpenAI's formats (``LogprobFormatter``)."""

from __future__ import annotations


# ---- stop strings ------------------------------------------------------------------

class StopStrings:
    """Cuts streamed text at the first stop string, never letting part of one out.

    ``push(text)`` returns ``(text safe to send now, stopped)``. Text that could be
    the start of a stop string is held back until the next piece decides it; the
    stop string itself is never sent (as in OpenAI's API). ``flush()`` releases
    what is held when the stream ends without a stop.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def push(self, text: str) -> tuple[str, bool]:
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[:min(hits)], True
        keep = 0            # the longest end of buf that begins some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


# ---- log-probabilities -------------------------------------------------------------

def token_text(tokenizer, token_id: int) -> str:
    """One token as text: its characters, a special token's name, or, for bytes that are
    not whole UTF-8 characters (a part of one), ``bytes:\\xe4\\xbd`` (so that the
    alternatives listed for one position stay distinct)."""
    data = tokenizer.token_bytes(token_id)
    if not data and tokenizer.is_special(token_id):
        return tokenizer.decode([token_id], skip_special_tokens=False)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class LogprobFormatter:
    """``logprobs`` of one choice in OpenAI's format: the completions one (tokens,
    token_logprobs, top_logprobs, text_offset) or the chat one (content: [{token,
    logprob, bytes, top_logprobs}]). Entries come from ``Request.logprobs``."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat, self.offset = tokenizer, chat, 0

    def format(self, token_ids: list[int], entries: list) -> dict:
        tok = self.tokenizer
        if self.chat:
            def item(t, lp):
                return {"token": token_text(tok, t), "logprob": lp,
                        "bytes": list(tok.token_bytes(t))}
            return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]}
                                for t, (lp, top) in zip(token_ids, entries)]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, (lp, top) in zip(token_ids, entries):
            text = token_text(tok, t)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({token_text(tok, i): v for i, v in top})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    @staticmethod
    def join(parts: list[dict], chat: bool) -> dict:
        """Several ``format`` results as one (a whole, non-streamed response)."""
        if chat:
            return {"content": [c for p in parts for c in p["content"]]}
        return {k: [x for p in parts for x in p[k]]
                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
