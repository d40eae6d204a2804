"""The draft head's training prompts: written for this repo, no downloads.

First-stage prompts combine a task template with a topic (chat questions, explanations,
advice, stories, emails, code, arithmetic word problems, translations). Second-stage prompts
are built from the target's own first-stage answers, the way users reuse text: summarise it,
rewrite it, answer a question from it, document or edit the code. Every prompt is one user
turn; about ``eval_fraction`` of the topics are held apart for evaluation (no training prompt
shares a topic with an evaluation prompt).
"""

from __future__ import annotations

import hashlib
import random

TOPICS = (
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "the immune system",
    "climate change", "plate tectonics", "the French Revolution", "the Roman Empire",
    "the printing press", "the internet", "electric cars", "solar panels", "wind turbines",
    "recycling", "coral reefs", "honey bees", "sleep", "meditation", "running a marathon",
    "learning a language", "public speaking", "time management", "saving money",
    "investing in index funds", "starting a small business", "remote work", "job interviews",
    "writing a resume", "cooking pasta", "baking bread", "growing tomatoes", "keeping a cat",
    "training a puppy", "birdwatching", "chess", "the guitar", "jazz", "the Olympic Games",
    "football", "cycling to work", "hiking safety", "camping", "travelling to Japan",
    "visiting Paris", "the Moon landing", "Mars exploration", "the periodic table", "DNA",
    "vaccines", "antibiotics", "the heart", "nutrition", "drinking enough water", "coffee",
    "tea", "chocolate", "the history of writing", "libraries", "museums", "democracy",
    "taxes", "inflation", "supply and demand", "the stock market", "cryptocurrency",
    "machine learning", "neural networks", "databases", "version control with git",
    "unit testing", "recursion", "sorting algorithms", "binary search", "hash tables",
    "web servers", "HTTP", "passwords and security", "phishing emails", "cloud computing",
    "smartphones", "batteries", "3D printing", "robots", "self-driving cars", "bridges",
    "skyscrapers", "earthquakes", "hurricanes", "rainforests", "deserts", "the ocean",
    "whales", "dinosaurs", "evolution", "the solar system", "gravity", "magnets",
    "electricity", "light", "sound", "rainbows", "snow", "volunteering", "friendship",
    "moving to a new city", "planning a wedding", "birthday parties", "board games",
    "video games", "photography", "painting", "poetry", "Shakespeare", "fairy tales",
    "the Great Wall of China", "ancient Egypt", "the Vikings", "pirates", "castles",
)

FIRST_STAGE = (
    ("chat", "What is {topic}? Explain it simply."),
    ("chat", "Can you tell me something interesting about {topic}?"),
    ("chat", "Why does {topic} matter to ordinary people?"),
    ("chat", "I am a beginner. How should I get started with {topic}?"),
    ("chat", "What are common misconceptions about {topic}?"),
    ("explain", "Explain {topic} to a ten-year-old."),
    ("explain", "Write a short paragraph about {topic}."),
    ("explain", "Describe the history of {topic} in a few sentences."),
    ("advice", "Give me five tips about {topic}."),
    ("advice", "List the pros and cons of {topic}."),
    ("writing", "Write a short poem about {topic}."),
    ("writing", "Write a very short story that involves {topic}."),
    ("writing", "Write a friendly email inviting a colleague to a talk about {topic}."),
    ("writing", "Write a blog post introduction about {topic}."),
    ("code", "Write a Python function related to {topic} and explain it."),
    ("code", "Write a small Python class that models {topic}."),
    ("math", "Make up a simple arithmetic word problem about {topic} and solve it step by "
             "step."),
    ("translate", "Translate into French: 'I would like to learn more about {topic}.'"),
    ("translate", "Translate into Spanish: 'My friend told me a story about {topic}.'"),
)

SECOND_STAGE = (
    ("summarise", "Summarize the following text in two sentences:\n\n{text}"),
    ("summarise", "Give three bullet points that capture this text:\n\n{text}"),
    ("rewrite", "Rewrite the following text in a more formal tone:\n\n{text}"),
    ("rewrite", "Fix any errors and make this text clearer:\n\n{text}"),
    ("rag", "Using only the passage below, answer: what is the main idea?\n\n{text}"),
    ("code_edit", "Add docstrings and type hints to this code:\n\n{text}"),
    ("code_edit", "Rewrite this code to be more readable:\n\n{text}"),
)


def topic_is_held_apart(topic: str, eval_fraction: float) -> bool:
    """Deterministic split by topic (never by the process's hash seed)."""
    digest = int(hashlib.sha256(topic.encode()).hexdigest()[:8], 16)
    return digest / 0xFFFFFFFF < eval_fraction


def first_stage_prompts(num: int, seed: int, eval_fraction: float = 0.1,
                        ) -> tuple[list[str], list[str]]:
    """``(train, eval)`` first-stage prompts: up to ``num`` training prompts in a seeded
    order, and every held-apart topic's prompts."""
    train: list[str] = []
    held: list[str] = []
    for topic in TOPICS:
        for _kind, template in FIRST_STAGE:
            prompt = template.format(topic=topic)
            (held if topic_is_held_apart(topic, eval_fraction) else train).append(prompt)
    random.Random(seed).shuffle(train)
    random.Random(seed + 1).shuffle(held)
    return train[:num], held


def second_stage_prompts(answers: list[tuple[str, str]], num: int, seed: int) -> list[str]:
    """Prompts reusing first-stage ``(prompt, answer)`` pairs: code tasks for code answers,
    prose tasks for the others."""
    rng = random.Random(seed)
    out: list[str] = []
    prose = [t for k, t in SECOND_STAGE if k != "code_edit"]
    code = [t for k, t in SECOND_STAGE if k == "code_edit"]
    for _prompt, answer in answers:
        text = answer.strip()
        if len(text) < 80:
            continue
        is_code = "def " in text or "class " in text
        templates = code if is_code else prose
        out.append(rng.choice(templates).format(text=text[:1500]))
        if len(out) >= num:
            break
    return out


# Prompts the target writes itself (device runs): a request to write a user's message about
# a training topic, sampled many times; :func:`clean_written_prompt` keeps the usable ones.
SELF_PROMPT_REQUESTS = (
    "Write one question that a curious person might ask an AI assistant about {topic}. "
    "Reply with the question only.",
    "Write a request that a student might send to a chatbot about {topic}. Reply with the "
    "request only.",
    "Write a task about {topic} that someone could ask an assistant to do, such as writing, "
    "explaining, comparing or planning something. Reply with the task only.",
    "Write a programming question related to {topic} that a developer might ask. Reply with "
    "the question only.",
    "Write a question asking for practical advice about {topic}. Reply with the question "
    "only.",
    "Write an instruction asking an assistant to write a story, a poem, a letter or a "
    "speech about {topic}. Reply with the instruction only.",
)

# Second user turns (device runs): generic follow-ups, and edits of code the target wrote
# (the agentic pattern: re-emitting or editing an earlier answer).
FOLLOW_UPS = (
    "Can you make that shorter?", "Explain that in more detail.", "Give me an example.",
    "Can you put that in a bulleted list?", "Summarize your answer in one sentence.",
    "Rewrite your answer for a ten-year-old.", "What else should I know?",
    "Can you make it more formal?", "Translate your answer into French.", "Why is that?",
    "Can you give me three more ideas?", "Rewrite it in a friendlier tone.",
    "Thanks! Can you turn that into a short email to my team?",
)
CODE_FOLLOW_UPS = (
    "Add comments to the code.", "Add type hints and docstrings to the code.",
    "Rewrite the code with clearer variable names.", "Add error handling to the code.",
    "Write a unit test for this code.", "Explain the code line by line.",
)


def self_prompt_requests(num: int, seed: int, eval_fraction: float = 0.1) -> list[str]:
    """``num`` requests for the target to write a user prompt, over the training topics
    (held-apart topics excluded) in a seeded order; requests repeat (they are sampled)."""
    topics = [t for t in TOPICS if not topic_is_held_apart(t, eval_fraction)]
    pairs = [(template, topic) for template in SELF_PROMPT_REQUESTS for topic in topics]
    rng = random.Random(seed + 2)
    out: list[str] = []
    while len(out) < num:
        rng.shuffle(pairs)
        out += [template.format(topic=topic) for template, topic in pairs]
    return out[:num]


def clean_written_prompt(text: str) -> str | None:
    """A target-written prompt, tidied (first paragraph, quotes and a "Question:"-style
    label removed), or None when it is too short, too long or not a request."""
    text = text.strip().split("\n\n")[0].strip()
    for label in ("Question:", "Request:", "Task:", "Instruction:", "User:", "Prompt:"):
        if text.lower().startswith(label.lower()):
            text = text[len(label):].strip()
    text = text.strip().strip('"“”\'').strip()
    if not 12 <= len(text) <= 400 or sum(ch.isalpha() for ch in text) < 8:
        return None
    return text


def follow_up_turns(answers: list[tuple[str, str]], num: int, seed: int,
                    ) -> list[list[dict[str, str]]]:
    """Up to ``num`` two-turn conversations (``[user, assistant, user]`` messages) that
    continue first-stage ``(prompt, answer)`` pairs with a follow-up."""
    rng = random.Random(seed + 3)
    out: list[list[dict[str, str]]] = []
    for prompt, answer in answers:
        text = answer.strip()
        if len(text) < 40:
            continue
        is_code = "def " in text or "class " in text
        follow = rng.choice(CODE_FOLLOW_UPS if is_code and rng.random() < 0.7 else FOLLOW_UPS)
        out.append([{"role": "user", "content": prompt},
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": follow}])
        if len(out) >= num:
            break
    return out
