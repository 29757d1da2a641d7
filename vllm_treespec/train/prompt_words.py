"""The word lists and templates the training prompts are built from (data only;
see :mod:`prompts`). Topics, audiences, tones, formats, names, roles and objects
fill the instruction templates; classic exercises and code templates make the
"write a function" requests."""

from __future__ import annotations

TOPIC_GROUPS = {
    "science": "photosynthesis; black holes; plate tectonics; the water cycle; DNA replication; "
    "the immune system; climate change; renewable energy; quantum entanglement; the theory of "
    "evolution; vaccines; the periodic table; gravity; the speed of light; antibiotics; "
    "coral reefs; volcanoes; earthquakes; the human brain; sleep; nutrition; bees and "
    "pollination; ocean currents; the ozone layer; nuclear fusion; electric circuits; magnets; "
    "the solar system; exoplanets; the Big Bang; cell division; enzymes; the carbon cycle; "
    "rainforests; deserts; glaciers; weather forecasting; hurricanes; tides; sound waves; "
    "optics and lenses; thermodynamics; entropy; chemical bonds; acids and bases; batteries; "
    "semiconductors; superconductors; genetics; stem cells; the microbiome; viruses; fungi; "
    "dinosaurs; fossils; migration of birds; animal camouflage; the human heart; muscles; "
    "bones and the skeleton; the senses; memory; dreams",
    "technology": "artificial intelligence; machine learning; neural networks; the internet; "
    "cloud computing; cybersecurity; passwords; encryption; blockchain; smartphones; "
    "social media; video games; virtual reality; self-driving cars; 3D printing; robots; "
    "drones; satellites; GPS; databases; operating systems; open-source software; "
    "programming languages; version control with git; web browsers; search engines; email; "
    "spreadsheets; electric vehicles; solar panels; wind turbines; the printing press; "
    "the telephone; computer memory; compilers; recommendation systems; online privacy; "
    "data backups; wifi; smart homes",
    "society": "democracy; elections; taxes; inflation; unemployment; globalization; trade; "
    "supply and demand; the stock market; cryptocurrency; personal finance; budgeting; saving "
    "for retirement; credit cards; student loans; remote work; the four-day work week; "
    "urbanization; public transport; housing; immigration; human rights; free speech; "
    "education systems; homeschooling; standardized tests; online learning; volunteering; "
    "charity; small businesses; entrepreneurship; marketing; advertising; customer service; "
    "leadership; teamwork; negotiation; public speaking; time management; productivity",
    "history": "the Roman Empire; ancient Egypt; the Renaissance; the Industrial Revolution; "
    "the French Revolution; the American Revolution; World War I; World War II; the Cold War; "
    "the Silk Road; the Ming dynasty; the Ottoman Empire; the Vikings; the Aztecs; the Incas; "
    "the printing revolution; the Age of Exploration; the abolition of slavery; the civil rights "
    "movement; the moon landing; the fall of the Berlin Wall; ancient Greece; the Mongol Empire; "
    "medieval castles; the Black Death; the invention of writing; the history of medicine; "
    "the history of money; the history of the Olympic Games",
    "arts": "impressionist painting; classical music; jazz; hip hop; poetry; Shakespeare; "
    "the novel; film making; photography; architecture; sculpture; dance; theater; opera; "
    "comic books; street art; graphic design; fashion; pottery; calligraphy; storytelling; "
    "mythology; fairy tales; science fiction; mystery novels; museums; street photography; "
    "songwriting; learning the piano; learning the guitar",
    "life": "healthy eating; exercise; running a marathon; yoga; meditation; stress; "
    "making friends; moving to a new city; job interviews; writing a resume; learning a new "
    "language; travel on a budget; camping; gardening; houseplants; cooking pasta; baking "
    "bread; coffee; tea; keeping a journal; reading habits; raising children; caring for a "
    "dog; caring for a cat; adopting a pet; cleaning the house; minimalism; recycling; "
    "reducing plastic waste; saving energy at home; planning a wedding; hosting a dinner "
    "party; birthdays; holidays; road trips; first aid; staying safe online; motivation; "
    "procrastination; habits; studying for exams; choosing a university; retirement; hobbies",
    "places": "Japan; Brazil; Kenya; Iceland; Canada; India; Italy; Mexico; Egypt; Australia; "
    "Norway; Peru; Vietnam; Morocco; New Zealand; the Alps; the Sahara; the Amazon; the "
    "Arctic; the Himalayas; Paris; Tokyo; New York; London; Istanbul; Rome; Cairo; "
    "Rio de Janeiro; Sydney; Hawaii; Venice; Barcelona; a small fishing village; a busy market",
    "maths": "prime numbers; probability; statistics; fractions; percentages; algebra; geometry; "
    "the Pythagorean theorem; calculus; derivatives; integrals; linear equations; matrices; "
    "vectors; logarithms; exponential growth; compound interest; infinity; the number pi; "
    "graph theory; game theory; sets; logic; sequences and series; the Fibonacci sequence; "
    "complex numbers; trigonometry; averages; the normal distribution; sorting algorithms; "
    "binary numbers; recursion; big-O notation; hash tables; linked lists; binary search",
}

TOPICS: list[str] = [
    t.strip() for group in TOPIC_GROUPS.values() for t in group.split(";") if t.strip()
]

AUDIENCES = [
    "a five-year-old", "a ten-year-old", "a high school student", "a college student",
    "a busy professional", "a retired teacher", "a beginner", "an expert", "my grandmother",
    "a new employee", "a tourist", "a software engineer", "a nurse", "a small business owner",
    "a journalist", "a curious teenager", "a parent", "a non-native English speaker",
]
TONES = [
    "friendly", "formal", "humorous", "enthusiastic", "calm", "persuasive", "neutral",
    "inspiring", "serious", "casual", "poetic", "concise",
]
FORMATS = [
    "a bulleted list", "a numbered list", "a short paragraph", "three paragraphs",
    "a table", "a step-by-step guide", "a short essay", "a dialogue", "a FAQ",
    "a haiku", "a limerick", "a tweet", "an email", "a letter", "a blog post",
    "a speech", "a news article", "a product description", "a poem", "a short story",
]
NAMES = [
    "Alice", "Bob", "Carlos", "Dana", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal",
    "Kira", "Liam", "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq",
    "Uma", "Victor", "Wen", "Xavier", "Yara", "Zoe", "Mr. Brown", "Dr. Patel", "Ms. Lee",
]
ROLES = [
    "a pirate captain", "a medieval knight", "a detective", "a tour guide in Rome",
    "a personal trainer", "a chef", "a travel agent", "a museum curator", "a space explorer",
    "a wise old wizard", "a customer support agent", "a history teacher", "a math tutor",
    "a career coach", "a film critic", "a sports commentator", "a librarian", "a gardener",
    "a startup founder", "a park ranger", "a robot from the future", "a news anchor",
    "a nutritionist", "a poet", "a job interviewer", "a doctor", "a lawyer", "a barista",
]
OBJECTS = [
    "a water bottle", "a backpack", "a smartwatch", "a bicycle", "a coffee maker",
    "a pair of running shoes", "a desk lamp", "a notebook", "a phone case", "headphones",
    "a tent", "an electric toothbrush", "a board game", "a plant pot", "a kitchen knife",
]

INSTRUCT_TEMPLATES = [
    # explain / teach
    "Explain {topic} to {audience}.",
    "Explain {topic} in simple terms.",
    "What is {topic}? Give a short explanation and an example.",
    "How does {topic} work?",
    "Why is {topic} important?",
    "What are the most common misconceptions about {topic}?",
    "Give me {n} interesting facts about {topic}.",
    "Summarize the key ideas of {topic} in {format}.",
    "Describe the history of {topic} in a few paragraphs.",
    "What are the pros and cons of {topic}?",
    "Compare {topic} and {topic2}. How are they similar and how are they different?",
    "What is the connection between {topic} and {topic2}?",
    "Write a short lesson plan for teaching {topic} to {audience}.",
    "Create {n} quiz questions about {topic}, with answers.",
    "What would happen if {topic} suddenly disappeared?",
    "List {n} questions a student might ask about {topic}, and answer each briefly.",
    "I'm confused about {topic}. Can you help me understand it?",
    "Define {topic} in one sentence, then elaborate.",
    "What are the main challenges related to {topic} today?",
    "What does the future of {topic} look like?",
    # writing
    "Write {format} about {topic}.",
    "Write {format} about {topic} in a {tone} tone.",
    "Write a {tone} blog post about {topic} for {audience}.",
    "Write a short story about {name} and {topic}.",
    "Write a poem about {topic}.",
    "Write a persuasive essay arguing for {topic}.",
    "Write a speech for a school assembly about {topic}.",
    "Draft an email to {name} explaining {topic}.",
    "Write a professional email asking {name} for a meeting about {topic}.",
    "Write a thank-you note to {name} for helping with {topic}.",
    "Write a product description for {object}.",
    "Write an advertisement for {object} aimed at {audience}.",
    "Write a review of {object}.",
    "Write a travel blog post about a trip to {place}.",
    "Describe a day in the life of {role}.",
    "Write a dialogue between {name} and {name2} about {topic}.",
    "Write the opening paragraph of a novel set in {place}.",
    "Write a haiku about {topic}.",
    "Write a limerick about {name} and {object}.",
    "Write a short fairy tale that teaches a lesson about {topic}.",
    "Rewrite this sentence to be more {tone}: \"{sentence}\"",
    "Improve the grammar and style of this text: \"{sentence}\"",
    "Give {n} catchy titles for an article about {topic}.",
    "Write a tweet announcing a new event about {topic}.",
    "Write a motivational message for someone struggling with {topic}.",
    # advice / planning
    "Give me {n} tips for {topic}.",
    "How can I get better at {topic}?",
    "What should a beginner know about {topic}?",
    "Make a one-week plan to learn about {topic}.",
    "Plan a three-day trip to {place}.",
    "What should I pack for a trip to {place}?",
    "What are some good ways to save money while visiting {place}?",
    "Suggest {n} ideas for a birthday present for someone who loves {topic}.",
    "How do I explain {topic} to my boss?",
    "I have a job interview for a position involving {topic}. How should I prepare?",
    "What are {n} good habits related to {topic}?",
    "Create a daily schedule for {audience} that includes time for {topic}.",
    "Give me a checklist for {topic}.",
    # role-play
    "Pretend you are {role}. Introduce yourself and talk about {topic}.",
    "You are {role}. A visitor asks you about {topic}. What do you say?",
    "Act as {role} and give me advice about {topic}.",
    "Imagine you are {role} writing a diary entry about {topic}.",
    "As {role}, describe {place}.",
    "Role-play as {role}. I am a customer who wants to know about {object}.",
    # opinion / analysis
    "Is {topic} overrated? Give arguments on both sides.",
    "What are the ethical questions raised by {topic}?",
    "How has {topic} changed over the last fifty years?",
    "What can {audience} learn from {topic}?",
    "Analyze the impact of {topic} on society.",
    "What are three surprising ways {topic} affects everyday life?",
]

SENTENCES = [
    "me and him goes to the store yesterday and buyed some apple",
    "the meeting have been moved to tomorrow because of the the weather",
    "I think that maybe we could possibly consider starting the project soon",
    "our product is good and people like it and it is cheap",
    "she dont know nothing about the new rules",
    "This report contains information that is important for the reading of the team",
    "we was very happy to recieve your letter last week",
    "the cat sat on the mat it was very fluffy and it looked at the dog",
    "please send me the files asap thanks",
    "In my opinion, the movie was not bad but also not very good.",
]

FOLLOWUPS = [
    "Can you make it shorter?",
    "Can you explain that in simpler words?",
    "Now rewrite your answer for {audience}.",
    "Give me three more examples.",
    "Can you turn that into {format}?",
    "What is the most important point you made? Explain it in more detail.",
    "Summarize your answer in one sentence.",
    "Can you make it more {tone}?",
    "What are the limitations of what you just said?",
    "Translate the first sentence of your answer into French.",
    "Now write a short quiz based on your answer.",
    "Thanks! Can you add a conclusion?",
    "Can you give a real-world example?",
    "Rewrite it as a list of steps.",
    "Is there anything important you left out?",
]


CLASSIC_EXERCISES = [
    "reverses a string", "checks whether a string is a palindrome", "counts the vowels in a string",
    "returns the n-th Fibonacci number", "computes the factorial of a number", "checks whether a number is prime",
    "returns all prime numbers below n", "finds the largest element of a list", "removes duplicates from a list while keeping order",
    "merges two sorted lists", "flattens a nested list", "computes the average of a list of numbers",
    "counts how often each word appears in a text", "checks whether two strings are anagrams",
    "converts a decimal number to binary", "converts Celsius to Fahrenheit", "sorts a list of dictionaries by a key",
    "finds the second largest number in a list", "returns the common elements of two lists",
    "capitalizes the first letter of every word", "computes the greatest common divisor of two numbers",
    "checks whether brackets in a string are balanced", "implements binary search", "implements bubble sort",
    "implements quicksort", "rotates a list by k positions", "splits a list into chunks of size n",
    "computes the sum of the digits of a number", "checks whether a year is a leap year",
    "returns the longest word in a sentence", "transposes a matrix", "multiplies two matrices",
    "counts the number of islands in a grid", "finds the longest common prefix of a list of strings",
    "validates an email address with a regular expression", "parses a CSV line into fields",
    "computes the running sum of a list", "returns the indices of two numbers that add up to a target",
    "converts a Roman numeral to an integer", "converts an integer to a Roman numeral",
    "computes the median of a list", "finds the mode of a list", "checks whether a list is sorted",
    "generates all permutations of a list", "generates all subsets of a set", "computes n choose k",
    "compresses a string using run-length encoding", "decodes a run-length encoded string",
    "returns the k most frequent elements", "implements a stack class", "implements a queue with two stacks",
    "computes the depth of a binary tree", "performs a breadth-first search on a graph",
    "finds the shortest path in an unweighted graph", "detects a cycle in a linked list",
    "reads a file and counts its lines", "returns the number of days between two dates",
    "formats a number with thousands separators", "truncates a string to n characters with an ellipsis",
    "checks whether a number is a perfect square", "computes the power set of a string",
    "sums all even numbers in a list", "returns the product of all numbers in a list except the current one",
    "finds the missing number in a list from 1 to n", "counts the set bits of an integer",
    "checks whether a string contains only digits", "interleaves two lists", "zips two lists into a dictionary",
    "groups words by their first letter", "removes all whitespace from a string",
]

CODE_INSTRUCT_TEMPLATES = [
    "Write a Python function that {task}.",
    "Write a Python function that {task}. Include a docstring and a few examples.",
    "Implement a function in Python that {task}, and explain how it works.",
    "How would I write code that {task}? Use Python.",
    "Write a function that {task}. Then write two unit tests for it.",
    "Can you show me a simple Python program that {task}?",
    "Write an efficient Python function that {task} and state its time complexity.",
    "Write a JavaScript function that {task}.",
]
