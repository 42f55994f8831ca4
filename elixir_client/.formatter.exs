[inputs: ["{mix,.formatter}.exs", "{lib,test,bench,scripts}/**/*.{ex,exs}"], line_length: 100]
