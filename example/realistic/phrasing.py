"""How users word their requests: two disjoint phrasing banks.

Bank ``A`` is used with the sources a cross-source split trains on, bank ``B``
with the held-out ones, so a classifier evaluated on the cross-source split has
seen neither the held-out files nor the way those requests are worded. Each
bank has its own leads, questions and tics (B is terser, lower-case, chattier).
Slots: {name} {path} {lang} {pkg} {other}.
"""

from __future__ import annotations

import random

LANG = {"code-python": "Python", "code-c": "C", "code-js": "JavaScript", "code-rust": "Rust", "ops": "shell", "prose": "docs", "math": "math"}
OTHER_LANG = {"code-python": ("Rust", "Go", "TypeScript"), "code-c": ("Rust", "Zig", "Python"), "code-js": ("TypeScript", "Python", "Go"),
              "code-rust": ("C++", "Go", "Python"), "ops": ("a Dockerfile", "a GitHub Actions job", "a systemd unit")}

BANK: dict[str, dict[str, tuple[str, ...]]] = {
    "A": {
        "short": ("What does `{name}` in {path} do?", "How is `{name}` meant to be used? It's from {pkg}.",
                  "Is `{name}` ({pkg}) safe to call from several threads at once?", "What does `{name}` return when its input is empty?",
                  "Could you explain the purpose of `{name}` in {path}?", "When should I use `{name}` rather than writing my own?",
                  "What are the performance characteristics of `{name}` in {pkg}?", "Why would `{name}` raise an error on valid-looking input?"),
        "prose_short": ("What is the section on {name} about?", "Could you explain what the {pkg} docs mean by {name}?",
                        "Where in the {pkg} documentation is {name} described, and what does it say?", "Summarise the idea behind {name}."),
        "ops_short": ("What does the `{name}` setting in {path} control?", "How do I override `{name}` from {path} without editing the file?",
                      "Is `{name}` in {path} required, or does it have a default?", "What breaks if I remove `{name}` from {path}?"),
        "ops_ask": ("What does this configuration do, line by line?", "Is anything here insecure or deprecated?",
                    "How would you convert it to {other}?", "Which of these settings matter in production?"),
        "lead": ("Here is a function from {path}:", "I'm reading this code in {pkg} and could use some help:", "Please review the following {lang} code.",
                 "This is from {path} in our vendored copy of {pkg}:", "I found the following in {path}.", "Consider this {lang} snippet:"),
        "ask": ("What does it do, step by step?", "Is there a bug in it? Please explain your reasoning.", "How would you write unit tests for it?",
                "Could you add comments explaining the non-obvious parts?", "What are the edge cases I should worry about?",
                "How would you simplify it without changing behaviour?", "Can you port it to {other}?", "What is its time complexity?"),
        "log_lead": ("I'm getting the following error and I don't understand it:", "Our CI run failed with this output:",
                     "This happens every time I run the job:", "Could you help me interpret this error output?"),
        "log_ask": ("What is the root cause, and how do I fix it?", "Which line is actually at fault here?",
                    "Is this a problem in my code or in the library?", "How can I reproduce this in a minimal example?"),
        "prose_lead": ("Here is a passage from the {pkg} documentation:", "I'm reading this section of the docs ({path}):",
                       "The following paragraph is from {path}:"),
        "prose_ask": ("Could you summarise it in two sentences?", "What does it mean in practice?", "Please rewrite it for a beginner.",
                      "What are the key terms I need to understand here?", "Can you turn this into a short checklist?"),
        "math": ("{statement}", "Can you solve this and show every step? {statement}", "I need help with this problem: {statement}",
                 "Please work through the following. {statement}"),
        "follow": ("Thanks, that helps. One more question:", "Understood. Next:", "Great. Related to that:", "That makes sense. Also,"),
        "context": ("We are migrating a service written in {lang} and I'm auditing the code we depend on.",
                    "I maintain a small internal tool and I'm trying to understand the library code it calls.",
                    "I'm preparing a code review for a colleague and want to be sure I understand this part.",
                    "Our team is writing documentation for new hires, so accuracy matters more than brevity."),
        "math_context": ("I'm revising for an exam and want to check my method.", "I tutor a student and need a clear worked solution.",
                         "This came up while checking a spreadsheet at work."),
        "math_require": ("Show every intermediate step.", "State the final answer clearly on its own line.", "Explain why each step is valid."),
        "require": ("Keep the public interface unchanged.", "Explain any trade-offs you make.", "Point out anything that looks unsafe.",
                    "Prefer the standard library where possible.", "Mention which tests would catch a regression."),
    },
    "B": {
        "short": ("whats {name} for", "{name} - when would i actually need it", "eli5 `{name}` pls", "does {name} allocate?",
                  "quick q, {pkg}'s {name}: blocking or not?", "is {name} deprecated or still the way to go", "why does {name} exist at all",
                  "tl;dr of what {path} handles?"),
        "prose_short": ("{name}?? what is it", "docs on {name}, short version pls", "what do the {pkg} docs even mean by {name}"),
        "ops_short": ("what does `{name}` do in {path}", "can i just drop `{name}` from {path}", "default for `{name}`?", "`{name}` in {path} - needed?"),
        "ops_ask": ("anything dumb in here", "make this prod-ready", "convert to {other} pls", "why does it look like this"),
        "lead": ("ok so this bit", "found this in {path}, wtf is it doing", "pasting the relevant part", "this is the thing that breaks:",
                 "from {pkg}, fyi", "so i have this"),
        "ask": ("why is it written like this", "any edge cases that blow up?", "rewrite it so a human can read it", "would this be faster in {other}?",
                "what would you rename here", "is this even correct lol", "can i delete half of this", "explain like im new to {lang}"),
        "log_lead": ("help, this keeps happening", "getting this now:", "started after the upgrade:", "build is red again"),
        "log_ask": ("ideas?", "what am i missing", "fix??", "is it me or the lib", "been stuck on this for an hour"),
        "prose_lead": ("docs say this and i don't get it:", "tldr this pls", "from the {pkg} docs:"),
        "prose_ask": ("in plain words?", "so what do i actually do", "is this still true?", "give me the gist", "bullet points pls"),
        "math": ("{statement} pls show work", "stuck on this one: {statement}", "{statement} (homework, just want to check my method)",
                 "quick check - {statement}"),
        "follow": ("ok and", "cool. next one", "also", "one more thing"),
        "context": ("context: inherited this repo, zero docs.", "side project, nothing serious.", "prod is on fire so short answers pls.",
                    "learning {lang} on the side."),
        "math_context": ("homework, due tomorrow", "just checking my answer", "been a while since school lol"),
        "math_require": ("steps pls", "just the method", "short"),
        "require": ("dont change the api", "no new deps", "keep it short", "tests would be nice"),
    },
}


CONFIG_LANG = {".json": "JSON", ".yaml": "YAML", ".yml": "YAML", ".toml": "TOML", ".ini": "INI", ".cfg": "INI", ".conf": "config",
               ".sh": "shell", ".bash": "shell", ".mk": "Makefile", ".def": "python-build definition"}


def lang_of(domain: str, path: str) -> str:
    """What the user calls the pasted text: the language, or the config format for ops files."""
    if domain != "ops":
        return LANG[domain]
    name = path.split("/")[-1]
    if name in ("Makefile", "GNUmakefile"):
        return "Makefile"
    return next((v for k, v in CONFIG_LANG.items() if name.endswith(k)), "shell")


def fill(template: str, slots: dict[str, str]) -> str:
    out = template
    for k, v in slots.items():
        out = out.replace("{" + k + "}", v)
    return out


def pick(rng: random.Random, bank: str, key: str, slots: dict[str, str]) -> str:
    return fill(rng.choice(BANK[bank][key]), slots)


def tic(rng: random.Random, bank: str, text: str) -> str:
    """Bank B's tics: lower-case, dropped final punctuation; both banks sometimes greet or thank."""
    if bank == "B" and "```" not in text and rng.random() < 0.5:
        text = text.lower().rstrip(".")
    if rng.random() < 0.15:
        text = rng.choice(("Hi! ", "Hey, ", "hello - ", "Morning. ")) + text
    if rng.random() < 0.15:
        text += rng.choice((" Thanks!", " thx", " Appreciate it.", " cheers"))
    return text
