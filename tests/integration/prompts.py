"""Prompts for integration tests (written for these tests; not from any benchmark)."""

CHAT_PROMPTS = [
    "Explain in three sentences why the sky looks blue.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "List five fruits that are rich in vitamin C.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a short recipe for pancakes.",
    "Summarise the plot of a story about a lost dog finding its way home.",
    "How do I reverse a string in JavaScript?",
    "Write a haiku about autumn leaves.",
    "What are the main causes of inflation?",
    "Describe how a bicycle works to a ten-year-old.",
    "Write a SQL query that counts the rows of a table named orders.",
    "Why do cats purr?",
    "Give three tips for writing clear emails.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "What is a binary search and when should I use it?",
    "Write a limerick about a programmer who loves coffee.",
    "Explain what a hash map is.",
    "Suggest a name for a bakery that sells only bread.",
    "How many minutes are there in a week? Show your steps.",
    "Write a short motivational message for a student before an exam.",
    "What does the HTTP status code 404 mean?",
    "Describe the water cycle.",
    "Write a bash command that counts the lines in all .txt files.",
    "What is the capital of Australia, and why is it not Sydney?",
    # Longer than three 32-token blocks with the chat template: asked twice, its
    # second request reuses cached blocks at every supported block size.
    "I am planning a one-week trip by train through the mountains in late autumn. I "
    "will carry one small backpack, I do not like cold mornings, and I want to spend "
    "at least two days hiking. Write a packing list grouped by clothing, gear and "
    "food, and explain each choice in one short sentence.",
]


def chat_token_ids(tokenizer, prompts=CHAT_PROMPTS) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                           add_generation_prompt=True, tokenize=False)
             for p in prompts]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
