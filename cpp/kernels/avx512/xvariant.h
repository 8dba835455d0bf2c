#define XD 16
#define XH _MM_HINT_NTA
